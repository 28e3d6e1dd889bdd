"""The options of ``aiak bench``, apart from the command (which loads torch): ``aiak --help`` builds every
subcommand's parser, and stays fast (`aiak.cli.main`)."""
from __future__ import annotations

from aiak.cli.args import MODEL_HELP, device as device_type, input_shape, whole_number
from aiak.measure.thresholds import MIN_ROUNDS_FOR_VERDICT

__all__ = ["add_arguments", "DEFAULT_STEPS", "DEFAULT_ROUNDS", "TRACE_STEPS"]

DEFAULT_STEPS = 40
DEFAULT_ROUNDS = 20
TRACE_STEPS = 3     # steps of each contender in a --trace


def add_arguments(parser) -> None:
    """The options of ``aiak bench`` (``aiak.cli`` builds the subcommand's parser and calls this)."""
    parser.add_argument("--model", default="demo", metavar="SPEC", help=MODEL_HELP)
    parser.add_argument("--strategy", action="append", default=None, metavar="STRATEGY",
                        help="auto, a built-in profile name (aiak profiles lists them) or a path to a YAML profile; "
                             "repeat it to compare several (default: auto)")
    parser.add_argument("--batch-size", type=whole_number(1), default=None, metavar="N",
                        help="samples per step on each worker (default: 64 for demo, 32 otherwise)")
    parser.add_argument("--input-shape", type=input_shape, default=None, metavar="C,H,W",
                        help="image size (e.g. 3,64,64), or one number, the sequence length, for a text model "
                             "(default: the model's own)")
    parser.add_argument("--steps", type=whole_number(1), default=None, metavar="N",
                        help="timed steps per contender, cut into --rounds rounds "
                             f"(default: {DEFAULT_STEPS}, or --rounds if that is more)")
    parser.add_argument("--warmup", type=whole_number(0), default=5, metavar="N",
                        help="untimed steps per contender first, alternating (they train too)")
    parser.add_argument("--rounds", type=whole_number(1), default=None, metavar="N",
                        help="rounds of alternation; the speedup is the median of their ratios, and a verdict needs "
                             f"{MIN_ROUNDS_FOR_VERDICT} or more (default: {DEFAULT_ROUNDS}, or --steps if that is "
                             "fewer)")
    parser.add_argument("--device", type=device_type, default=None, metavar="D",
                        help="cpu, cuda or cuda:N (default: cuda when available, else cpu; under torchrun each rank "
                             "takes cuda:LOCAL_RANK)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object on stdout, and the table on stderr")
    parser.add_argument("--trace", default=None, metavar="DIR",
                        help=f"after the timing, write a torch.profiler trace of {TRACE_STEPS} steps of each "
                             "contender to DIR/<name>.json (opens in https://ui.perfetto.dev)")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help='draw step time over steps, one line per contender (needs pip install "aiak[plot]")')
    parser.add_argument("--no-progress", action="store_true", help="no progress bars or status lines")
