"""The compiler passes, one per module, and the ordered pass list the backend runs."""
