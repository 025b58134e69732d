"""The `stagehand` command: inspect, schedule, plan, demo, plot, env (`stagehand --help`).

TARGET is a preset (tiny-llama, tiny-gpt2, tiny-flux, dit-48x3072) or `path/to/file.py:factory` naming a function
that returns (model, example_inputs). Usage errors (`UsageError` and the library errors `usage.user_errors` lists)
print one line to stderr and exit with status 2; any other exception is a bug and prints its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import traceback
from typing import Any

from torch_stagehand.app.progress import Stage
from torch_stagehand.app.usage import (TargetFailed, UsageError, check_output_path, check_precision_range,
                                       check_vram_budget, one_line, parse_precision, user_errors)
from torch_stagehand.runtime import precision as precisions
from torch_stagehand.runtime.atomic_file import write_atomic
from torch_stagehand.version import __version__

DIT_CPU_TOKENS = 16  # on a CPU a few tokens keep the one forward explain() runs short


def resolve_device(name: str | None):
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: CUDA is not available on this machine (use --device cpu)")
    return torch.device(name)


def build_target(target: str, device) -> tuple[Any, Any]:
    """(model, example_inputs) for a preset or a file:factory target."""
    from torch_stagehand.app.presets import PRESETS, TargetError, load_target

    kwargs: dict[str, Any] = {}
    if target == "dit-48x3072":  # zeros build fast; tables and graphs do not depend on the values
        kwargs = {"init": "zeros"}
        if device.type != "cuda":
            kwargs["tokens"] = DIT_CPU_TOKENS
    try:
        return load_target(target, **kwargs)
    except TargetError as e:
        raise UsageError(str(e)) from None
    except Exception as e:  # the user's file failed to import or its factory raised
        if target in PRESETS:
            raise
        raise TargetFailed(target, "", e) from None


def map_tensors(fn, inputs: Any) -> Any:
    """fn applied to every tensor in a target's inputs (a tensor, or dicts/tuples/lists of them)."""
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda v: fn(v) if isinstance(v, torch.Tensor) else v, inputs)


def prepare_training(model, inputs, lora_rank: int = 4) -> tuple[Any, Any, str]:
    """Freeze the base and make something trainable, so the backward graphs exist: with peft, LoRA (r=4) injected
    into every Linear that will stream, before offload; without it, the float inputs require grad. Returns (model,
    inputs, description)."""
    from torch_stagehand.runtime.blocks import find_blocks, streamed_layers
    from torch_stagehand.runtime.linear_like import is_conv1d

    model.requires_grad_(False)
    try:
        import peft
    except ImportError:
        inputs = map_tensors(lambda t: t.detach().requires_grad_(True) if t.is_floating_point() else t, inputs)
        return model, inputs, "peft not installed: grad enabled on the float inputs, base frozen"
    specs = streamed_layers(model, find_blocks(model))
    targets = [s.fqn for s in specs]
    config = peft.LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0, target_modules=targets,
                             fan_in_fan_out=bool(specs) and all(is_conv1d(s.module) for s in specs))
    peft.inject_adapter_in_model(config, model)
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(dtype)  # adapters in the model's dtype
    return model, inputs, f"LoRA r={lora_rank} on {len(targets)} block Linears (peft), base frozen"


@contextlib.contextmanager
def _quiet_library_logs(preimport: bool = False):
    """diffusers logs a dtype advice when a preset casts a model; it would break the progress line."""
    if preimport:  # diffusers sets its root logger's level on first import: import it first
        import diffusers.utils.logging  # noqa: F401
    loggers = [logging.getLogger(name) for name in ("diffusers", "transformers")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def load_config(text: str | None):
    from torch_stagehand.config import Config, ConfigError

    if text is None:
        return None
    if os.path.isdir(text):
        raise UsageError(f"--config {text!r} is a directory (give a JSON file or JSON text)")
    try:
        return Config.from_json(text)
    except ConfigError as e:
        raise UsageError(f"--config: {e}") from None
    except OSError as e:  # exists but cannot be read (permissions, a broken link, ...)
        raise UsageError(f"--config {text!r}: {e.strerror or e}") from None


def explain_target(args) -> tuple[Any, Any]:
    """Build, offload and explain a target as the CLI options say. Returns (report, runtime)."""
    import torch

    import torch_stagehand as stagehand
    from torch_stagehand.config import Config
    from torch_stagehand.app.presets import PRESETS, call_model
    from torch_stagehand.runtime.blocks import find_blocks

    precision = parse_precision(args.precision)
    vram_budget = check_vram_budget(args.vram_budget)
    config = load_config(args.config)
    device = resolve_device(args.device)
    if config is None and args.target == "dit-48x3072":  # zero weights: the MSE clipping search is for nothing
        config = Config(quantizer="absmax")
    # Presets can take a while; a file target's errors must stay one line.
    building = Stage(f"building {args.target}") if args.target in PRESETS else contextlib.nullcontext()
    with building, _quiet_library_logs(preimport=args.target == "tiny-flux"):
        model, inputs = build_target(args.target, device)
    n_blocks = len(find_blocks(model))  # no blocks: BlockSelectionError, one line like every usage.user_errors()
    precision = check_precision_range(precision, n_blocks)
    how = "inference, no grad"
    if args.train:
        model, inputs, how = prepare_training(model, inputs)
    with Stage(f"offloading {n_blocks} blocks to the host store (precision {args.precision}, device {device})"):
        # verbose=False: this Stage line is the progress; the summary would split it
        rt = stagehand.offload(model, device=device, precision=precision, config=config, verbose=False,
                               vram_budget=vram_budget)
    inputs = map_tensors(lambda t: t.to(device), inputs)
    torch._dynamo.reset()  # a fresh Dynamo cache: every graph of this target is compiled (and reported) anew
    grad = torch.enable_grad() if args.train else torch.no_grad()
    with Stage(f"compiling and running one forward [{how}]"), grad:
        try:
            report = call_model(lambda *a, **kw: stagehand.explain(model, *a, **kw), inputs)
        except Exception as e:
            if args.target in PRESETS:  # a preset that fails is our bug: its traceback is the report
                raise
            raise TargetFailed(args.target, "its forward failed: ", e) from None
    return report, rt


def _print_overview(table: str, report, then: str) -> None:
    """A table, the report's summary line and its graph breaks, then a second table."""
    print(f"{table}\n\n{report.summary()}")
    for reason in report.graph_breaks:
        print(f"graph break: {reason}")
    print(f"\n{then}")


def cmd_inspect(args) -> int:
    report, _ = explain_target(args)
    _print_overview(report.segment_table(), report, report.pass_table())
    shown = {name: code for name, code in report.graphs.items() if not args.graph or args.graph in name}
    for name, code in shown.items():
        print(f"\n==== {name} " + "=" * max(4, 72 - len(name)))
        print(code.rstrip())
    if args.graph and not shown:
        raise UsageError(f"--graph {args.graph!r} matches none of: {', '.join(report.graphs)}")
    return 0


def cmd_schedule(args) -> int:
    for flag, path in (("--json", args.json), ("--timeline", args.timeline)):
        if path:
            check_output_path(flag, path, folder=False)
    report, rt = explain_target(args)
    _print_overview(report.table(), report, report.plan_table())
    if args.timeline:
        from torch_stagehand.app.plots import timeline_figure

        timeline_figure(rt.plan.timeline(), report.blocks, args.timeline,
                        f"{args.target}: one step as the plan predicts it{rt.plan.cost_note} "
                        f"({rt.plan.summary().split(';')[0]})")
        print(f"wrote the predicted step timeline to {args.timeline}", file=sys.stderr)
    if args.json:
        payload = {
            "target": args.target, "blocks": report.blocks, "precision": {str(b): p for b, p in rt.precision.items()},
            "summary": report.summary(), "graph_breaks": report.graph_breaks,
            "rows": [dict(row.as_dict(), block_name=report.blocks[row.block]) for row in report.schedule],
            "plan": {"summary": rt.plan.summary(), "slots": rt.plan.slots, "lookahead": rt.plan.lookahead,
                     "predicted_step_s": rt.plan.predicted_step_s, "cost_model": rt.plan.cost_model,
                     "predicted_peak_bytes": rt.plan.predicted_peak_bytes,
                     "blocks": [dict(p.__dict__) for p in rt.plan.blocks]},
        }
        try:
            write_atomic(os.path.abspath(args.json), json.dumps(payload, indent=1))
        except OSError as e:
            raise UsageError(f"--json {args.json!r}: {e.strerror or e}") from None
        print(f"wrote {len(report.schedule)} rows to {args.json}", file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    from torch_stagehand.app import demo  # a library of its own: the option checks live here

    if args.steps is not None and args.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {args.steps}")
    check_output_path("--out", args.out, folder=True)
    device = resolve_device(args.device)
    shape = demo.GPU_SHAPE if device.type == "cuda" else demo.CPU_SHAPE
    precision = None
    if args.precision is not None:
        precision = check_precision_range(parse_precision(args.precision), shape.layers)
    config = load_config(args.config)
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise UsageError(f"the demo needs transformers and peft ({e}); pip install -e '.[test]'") from None

    result = demo.run(steps=args.steps, device=str(device), out=args.out, seed=args.seed, precision=precision,
                      inner=args.inner, config=config)
    demo.print_result(result)
    return 0


def cmd_plot(args) -> int:
    from torch_stagehand.app.telemetry_plots import plot_telemetry

    out = args.out or os.path.dirname(os.path.abspath(args.telemetry))
    check_output_path("--out", out, folder=True)
    files = plot_telemetry(args.telemetry, out, title=args.title)  # a bad file: TelemetryFileError, one line
    for what, path in files.items():
        print(f"wrote {what:9s} {path}")
    return 0


def cmd_env(args) -> int:
    from tabulate import tabulate

    from torch_stagehand.environment import env, table

    # A bad value: env() raises a ConfigError naming the variable, one line.
    rows = [[row["variable"], row["default"], "" if row["set"] is None else f"{row['set']} -> {env(row['variable'])}",
             row["what"]] for row in table()]
    print(tabulate(rows, headers=["variable", "default", "set here", "what it does"], tablefmt="github"))
    return 0


def cmd_plan(args) -> int:
    from torch_stagehand.app.plan import PlanInputError, plan_folder, render

    if args.json:
        check_output_path("--json", args.json, folder=False)
    try:
        plan = plan_folder(args.folder, args.vram_budget, args.precision, args.train, args.tokens)
    except PlanInputError as e:
        raise UsageError(str(e)) from None
    print(render(plan))
    if args.json:
        write_atomic(os.path.abspath(args.json), json.dumps(plan.to_json(), indent=1))
    return 0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints usage + error)
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="preset (tiny-llama, tiny-gpt2, tiny-flux, dit-48x3072) or path/to/file.py:factory")
    p.add_argument("--precision", default=precisions.FULL,
                   help="bf16 (full precision: the model's own dtype), int8, or a map like 0-3:int8,4:bf16 "
                        "(blocks it leaves out stay bf16); default bf16")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available, else cpu")
    p.add_argument("--train", action="store_true",
                   help="explain a training step: freeze the base, inject LoRA (peft) into the block Linears, "
                        "grad enabled; the backward graphs and schedule appear")
    p.add_argument("--config", default=None, metavar="JSON", help="a Config as a JSON file or JSON text")
    p.add_argument("--vram-budget", default=None, metavar="SIZE",
                   help="device memory the plan may use, with its unit: 20GiB, 512MB (the fastest plan that fits: "
                        "blocks kept resident, slots, recompute); on the CPU it bounds the device copy of the "
                        "streamed weights")
    p.add_argument("--debug", action="store_true", help="when a file target fails, print its traceback too")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="stagehand", description="torch-stagehand: look inside the backend, or run the demo.")
    parser.add_argument("--version", action="version", version=f"stagehand (torch-stagehand) {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("inspect", help="print the segment table and the rewritten graphs")
    _common(p)
    p.add_argument("--graph", default=None, metavar="SUBSTR", help="only the graphs whose name contains SUBSTR")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("schedule", help="print the prefetch / wait / evict schedule and its summary")
    _common(p)
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows (and blocks, precision) as JSON")
    p.add_argument("--timeline", default=None, metavar="PNG",
                   help="also draw one step as the plan predicts it: H2D, D2H and compute lanes per block")
    p.set_defaults(func=cmd_schedule)

    p = sub.add_parser("demo", help="LoRA-train a small byte-level LM on the Python stdlib's source through the backend")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 40 on a CPU, 200 on a GPU)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available, else cpu")
    p.add_argument("--out", default="./stagehand-demo-out", help="output directory (default ./stagehand-demo-out)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", default=None,
                   help="precision map (default: the first half of the blocks bf16, the second half int8)")
    p.add_argument("--inner", choices=["eager", "inductor"], default=None,
                   help="inner compiler (default: inductor on a GPU, eager on a CPU)")
    p.add_argument("--config", default=None, metavar="JSON", help="a Config as a JSON file or JSON text")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("plot", help="PNGs from a run's telemetry.jsonl: step timeline, memory, precision map")
    p.add_argument("telemetry", help="a telemetry JSONL file (Config.telemetry_file; the demo writes one)")
    p.add_argument("--out", default=None, help="output folder (default: the telemetry file's folder)")
    p.add_argument("--title", default=None, help="title prefix of the plots (default: the folder's name)")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("plan", help="the plan for a checkpoint folder, from its config alone (no weights, no GPU)")
    p.add_argument("folder", help="a transformers or diffusers model folder (its config.json)")
    p.add_argument("--vram-budget", required=True, help="the GPU memory the run may use: '16GiB', '24GB'")
    p.add_argument("--precision", default="int8", help="what the blocks stream in: bf16, int8 or fp8")
    p.add_argument("--train", default="lora", help="lora, full (HostAdamW's fp32 masters and moments) or none")
    p.add_argument("--tokens", type=int, default=4096, help="tokens of one training sample (batch 1)")
    p.add_argument("--json", help="also write the plan to this JSON file")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("env", help="the environment variables torch-stagehand reads: defaults, values set here")
    p.set_defaults(func=cmd_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as e:
        if isinstance(e, TargetFailed) and getattr(args, "debug", False):
            traceback.print_exception(e.error)
        return _usage_error(args, e)
    except KeyboardInterrupt:
        print("stagehand: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if isinstance(e, user_errors()):
            return _usage_error(args, e)
        raise  # a bug: its traceback is the report


def _usage_error(args, error: BaseException) -> int:
    print(f"stagehand {args.command}: error: {one_line(error)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
