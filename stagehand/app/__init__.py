"""The application: the `stagehand` command line, the demo, its presets and plots (built on the library API)."""
