"""`specdec bench`: our engine against the target alone, transformers' assisted generation
and llama.cpp's server, on the same weights, greedy, interleaved per prompt.

One module per part: `prompts` (the suite), `methods` (transformers' and ours),
`llama_server` (the peer), `runner` (warm-up, interleaving, the exactness self-check),
`results` (per-prompt results and summaries), `targets` (the bars, as data), `report`
(the JSON document), `cost_curve` (forward timings and the roofline), `under_load` (speed beside a
busy process, thread governor on and off), `render` (a report as markdown and charts);
`cli_bench` is the command line.
"""

from .cost_curve import (
    CostCurve,
    FusionGain,
    StepBytes,
    measure_bandwidth,
    measure_cost_curve,
    measure_fusion_gain,
    step_bytes,
)
from .llama_server import start_peers
from .methods import (
    ALL_METHODS,
    AUTO_DRAFTER,
    BASELINE,
    GREEDY,
    METHODS,
    OURS_PREFIX,
    PEER_METHODS,
    Decoding,
    EngineMethod,
    HfMethod,
    Method,
    Run,
    build_methods,
    needs_draft_model,
)
from .prompts import BenchPrompt, encode_prompt, load_prompts
from .report import BenchReport
from .results import EngineFigures, GroupSummary, Result, first_divergence, geomean
from .runner import BenchProgress, BenchSettings, check_exactness, run_bench
from .targets import TARGETS, Target, TargetCheck, check_targets
from .under_load import LoadRun, measure_under_load

__all__ = [
    "ALL_METHODS",
    "AUTO_DRAFTER",
    "BASELINE",
    "GREEDY",
    "METHODS",
    "OURS_PREFIX",
    "PEER_METHODS",
    "TARGETS",
    "BenchProgress",
    "BenchPrompt",
    "BenchReport",
    "BenchSettings",
    "CostCurve",
    "Decoding",
    "EngineFigures",
    "EngineMethod",
    "FusionGain",
    "GroupSummary",
    "HfMethod",
    "LoadRun",
    "Method",
    "Result",
    "Run",
    "StepBytes",
    "Target",
    "TargetCheck",
    "build_methods",
    "check_exactness",
    "check_targets",
    "encode_prompt",
    "first_divergence",
    "geomean",
    "load_prompts",
    "measure_bandwidth",
    "measure_cost_curve",
    "measure_fusion_gain",
    "measure_under_load",
    "needs_draft_model",
    "run_bench",
    "start_peers",
    "step_bytes",
]
