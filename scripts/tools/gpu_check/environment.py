"""Sections 1 and 2 of the GPU check: versions and the attention kernel each call really runs;
`pytest -m gpu`."""

from __future__ import annotations

import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import transformers

from scripts.tools.gpu_check.context import (
    GIB,
    REPO,
    Check,
    Figures,
    Skip,
    engine_target_from_hf,
    make_engine,
    recipe_draft,
)
from scripts.tools.gpu_check.models import (
    margin_target,
    tiny_qwen3_config,
)

ATTENTION_OP = re.compile(r"scaled_dot_product|flash|efficient_attention|cudnn_attention|flex"
                          r"|triton_tem|_math", re.IGNORECASE)


def attention_ops(fn: Callable[[], Any], cuda: bool) -> list[str]:
    """Names of the attention-related ops and kernels `fn()` runs, as the profiler sees them."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if ATTENTION_OP.search(e.name)})


def classify(ops: list[str]) -> str:
    """The backend a list of op names shows: math / cudnn / flash / efficient / flex[-compiled].

    Any math-kernel op wins (one fallback call is a failure); compiled flex attention shows as
    a Triton template kernel (`triton_tem_*`), eager flex as `flex_attention` aten-level ops.
    """
    joined = " ".join(ops).lower()
    if "attention_math" in joined:
        return "math"
    for name in ("cudnn_attention", "flash", "efficient_attention"):
        if name in joined:
            return name.replace("_attention", "")
    if "triton_tem" in joined:
        return "flex-compiled"
    if "flex" in joined:
        return "flex"
    return "unknown" if ops else "none"


def section_environment(ck: Check, fig: Figures) -> None:
    fig.update(
        python=platform.python_version(), torch=torch.__version__,
        transformers=transformers.__version__, cuda=torch.version.cuda,
        cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        device=str(ck.device), tiny=ck.tiny,
    )
    if ck.cuda:
        props = torch.cuda.get_device_properties(ck.device)
        fig.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                   memory_gib=round(props.total_memory / GIB, 1))
    else:
        fig.update(device_name=platform.processor() or platform.machine())
    fig["attention"] = probe_attention(ck)
    attention = fig["attention"]
    if ck.cuda:
        for name in ("prefill", "decode_rounds"):
            probe = attention[name]
            fig.expect(probe["backend"] not in ("math", "unknown", "none"),
                       f"{name}: the profiled attention is {probe['backend']!r} (expected a "
                       f"fused SDPA kernel); ops {probe['ops']}")
        train = attention["training_forward"]
        compiled = train["compiled_flex_functions"]
        fig.expect(train["backend"] == "flex-compiled"
                   or (isinstance(compiled, list) and bool(compiled) and train["backend"] != "math"),
                   "the draft's training forward does not run compiled flex attention")
    chosen = attention["engine_sdpa_backends"]
    if isinstance(chosen, str) and chosen.startswith("error"):
        fig.expect(False, f"engine.profiling.sdpa_backends: {chosen}")
    elif isinstance(chosen, dict):
        fig.expect({"prefill", "verify", "draft"} <= set(chosen),
                   f"sdpa_backends reports {sorted(chosen)}, not prefill, verify and draft")
        if ck.cuda:
            fig.expect(not any("MATH" in b for b in chosen.values()),
                       f"SDPA selects the math kernel: {chosen}")
    for name in ("prefill", "decode_rounds"):
        selected = attention[name].get("engine_selected")
        if isinstance(selected, dict):  # the engine's own record of SDPA's choice per call
            fig.expect(bool(selected), f"{name}: the engine recorded no attention call")
            if ck.cuda:
                math_calls = [label for label, chosen in selected.items() if "MATH" in chosen]
                fig.expect(not math_calls, f"{name}: SDPA selects the math kernel for {math_calls}")


def _sdpa_recorder() -> Callable | None:
    """The engine's per-call SDPA choice recorder (`record_sdpa_backends`), where it exists."""
    try:
        from dspine_train.modeling import sdpa_attention as attention
    except ImportError:
        return None
    return getattr(attention, "record_sdpa_backends", None)


def _compiled_flex_functions() -> list[str] | str:
    """The functions the training code's compiled-flex module has compiled so far."""
    try:
        from dspine_train.modeling import compiled_flex
    except ImportError:
        return "no compiled_flex module in this version"
    return sorted(getattr(compiled_flex, "_compiled", {}))


def probe_attention(ck: Check) -> dict[str, Any]:
    """Profile each attention call at the real attention layout (heads, head_dim, bf16).

    Eager engine (a graph replay runs no Python and shows no op names). `prefill` is a run that
    stops after the first token; `decode_rounds` adds speculative rounds (verify and draft
    calls). Each records the attention ops the profiler saw and, where the engine offers it,
    the backend SDPA's dispatcher chose for each labelled call.
    """
    from contextlib import nullcontext

    from dspine_train.objective import sample_anchors

    if ck.tiny:
        config = tiny_qwen3_config()
    else:  # Qwen3-8B's attention layout (32 x 128 query heads, 8 KV heads) on a narrow model
        config = tiny_qwen3_config(hidden_size=512, num_attention_heads=32, num_key_value_heads=8,
                                   head_dim=128, intermediate_size=256, vocab_size=1024,
                                   num_hidden_layers=2, max_position_embeddings=4096)
    hf, _ = margin_target(config, ck.device, torch.bfloat16)
    target = engine_target_from_hf(hf)
    draft = recipe_draft(hf, tiny=True)
    # Eager and uncompiled: the engine's recorder runs in Python, which graphs and compiled
    # steps skip; the kernels SDPA picks are the same.
    engine = make_engine(target, draft, max_batch_size=2, max_seq_len=256, cuda_graphs=False,
                         compile=False)
    prompts = [list(range(3, 67)), list(range(10, 50))]

    seq = torch.randint(0, 200, (1, 256), device=ck.device)
    width = config.hidden_size * len(draft.config.target_layer_ids)
    context = torch.randn(1, 256, width, device=ck.device, dtype=torch.bfloat16)
    anchor_pos, anchor_mask = sample_anchors(torch.ones(1, 256, dtype=torch.long), 16, 16,
                                             torch.Generator().manual_seed(0))
    anchor_pos, anchor_mask = anchor_pos.to(ck.device), anchor_mask.to(ck.device)

    def training_forward() -> None:
        with torch.enable_grad():
            draft.train()
            out = draft(seq, context, anchor_pos, anchor_mask)
            out.hidden.float().sum().backward()
            draft.eval()

    calls: dict[str, Callable[[], Any]] = {
        "prefill": lambda: engine.generate(prompts, max_new_tokens=1),
        "decode_rounds": lambda: engine.generate(prompts, max_new_tokens=6, num_draft_tokens=15),
        "training_forward": training_forward,
    }
    recorder = _sdpa_recorder()
    report: dict[str, Any] = {}
    try:
        from scripts.tools.bench.engine_profiling import sdpa_backends
    except ImportError:
        report["engine_sdpa_backends"] = "no engine.profiling in this engine version"
    else:
        try:  # strict: a call that would need the math kernel raises here
            report["engine_sdpa_backends"] = sdpa_backends(engine, strict=ck.cuda)
        except Exception as err:  # noqa: BLE001 - recorded and checked by the section
            report["engine_sdpa_backends"] = f"error: {type(err).__name__}: {err}"
    for name, fn in calls.items():
        fn()  # compile / warm up outside the profile
        use = recorder() if recorder is not None and name != "training_forward" else nullcontext()
        with use as recorded:
            ops = attention_ops(fn, ck.cuda)
        report[name] = dict(backend=classify(ops), ops=ops)
        if name == "training_forward":
            report[name]["compiled_flex_functions"] = _compiled_flex_functions()
        else:
            selected: dict[str, list[str]] = {}
            for label, backend in recorded or []:
                if backend not in selected.setdefault(label, []):
                    selected[label].append(backend)
            report[name]["engine_selected"] = (
                selected if recorded is not None else "no recorder in this engine version")
    return report


# ------------------------------------------------------------------ 2. pytest -m gpu
def section_gpu_tests(ck: Check, fig: Figures) -> None:
    if not ck.cuda:
        raise Skip("no CUDA: the gpu-marked tests skip themselves on CPU")
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                          timeout=ck.args.pytest_timeout)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    counts = {kind: int(n) for n, kind in re.findall(
        r"(\d+) (passed|failed|errors?|skipped|deselected)", "\n".join(tail))}
    fig.update(command=" ".join(cmd[1:]), returncode=proc.returncode, counts=counts,
               wall_s=round(time.perf_counter() - start, 1), tail=tail)
    fig.expect(proc.returncode == 0, f"pytest -m gpu exited {proc.returncode}")
    fig.expect(counts.get("passed", 0) > 0, "no gpu test passed")
