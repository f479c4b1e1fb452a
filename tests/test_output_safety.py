"""Outputs that must never replace inputs or foreign files, one run per output directory, and
full disks over an existing output (data loss; clear errors on ENOSPC).

The rule every tool follows (`dspine_train.owned_dir`): replace only what the tool itself wrote
(its marker) or an empty directory, refuse an output overlapping any input, check it before the
work starts; hold `dspine_train.output_lock` on an output directory for the life of the run.
"""

from __future__ import annotations

import resource
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from _engine_helpers import build_tiny_target, build_tokenizer, tiny_draft

from dspine_train.output_lock import OutputLockedError, acquire, lock_output, lock_path, release
from tests._train_helpers import REPO, train_env

VOCAB = 200


# ----------------------------------------------------------------------------- helpers
def tree(path: Path) -> dict[str, bytes | None]:
    """Every file under `path` with its bytes, and every directory (None): its exact content."""
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else None
            for p in sorted(path.rglob("*"))}


def run_python(args: list[str], file_size_limit: int | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """`python <args>` from the repo root; with `file_size_limit`, every file the process
    writes is capped at that many bytes (a write beyond fails with EFBIG, as on a full or
    size-limited disk)."""
    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    return subprocess.run([sys.executable, *args], cwd=REPO, env=train_env(),
                          capture_output=True, text=True, timeout=timeout,
                          preexec_fn=limit if file_size_limit else None)


def one_error_line(done: subprocess.CompletedProcess, *expected: str) -> str:
    """Non-zero exit, one `error:` line holding every `expected` text, no traceback."""
    assert done.returncode != 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, done.stderr[-2000:]
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


@contextmanager
def held_elsewhere(output: Path) -> Iterator[int]:
    """The output lock of `output` held by another process (a second run); yields its pid."""
    code = ("import sys; from dspine_train.output_lock import acquire; "
            "acquire(sys.argv[1], 'test'); print('locked', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", code, str(output)], cwd=REPO,
                              env=train_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield holder.pid
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


# ----------------------------------------------------------------------------- the lock
def test_a_second_holder_is_refused_naming_the_first(tmp_path):
    out = tmp_path / "out"
    with held_elsewhere(out) as pid:
        with pytest.raises(OutputLockedError) as refused:
            acquire(out, "output_dir")
    message = str(refused.value)
    assert message.startswith(f"output_dir: {out} is in use by another run: pid {pid} on ")
    assert "since 20" in message and "(command: " in message
    # the holder is gone: its lock went with it, and the lock file with a clean release
    with lock_output(out, "output_dir") as path:
        assert path == lock_path(out) and path.parent == tmp_path
    assert not lock_path(out).exists()


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    out = tmp_path / "out"
    code = ("import sys, os; from dspine_train.output_lock import acquire; "
            "acquire(sys.argv[1], 'test'); os._exit(0)")  # no release: as a kill
    assert run_python(["-c", code, str(out)]).returncode == 0
    assert lock_path(out).exists()  # left behind, but unlocked
    with lock_output(out, "output_dir"):
        pass


def test_the_lock_is_reentrant_in_one_process(tmp_path):
    out = tmp_path / "out"
    acquire(out, "a")
    acquire(out, "b")  # e.g. a trainer that tokenises into its own output directory
    release(out)
    with held_elsewhere(tmp_path / "other"):
        pass
    assert lock_path(out).exists()
    release(out)
    assert not lock_path(out).exists()


# ----------------------------------------------------------------------------- export
@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    """A tiny target (config, weights, tokenizer, generation config) and a draft export."""
    root = tmp_path_factory.mktemp("outputs")
    hf = build_tiny_target(root / "target", "qwen3", num_hidden_layers=6, eos_token_id=None)
    build_tokenizer(root / "target", vocab_size=VOCAB)
    tiny_draft(hf, VOCAB).save_pretrained(root / "draft")
    return {"root": root, "target": root / "target", "draft": root / "draft"}


def export(source: Path, out: Path, *extra: str,
           file_size_limit: int | None = None) -> subprocess.CompletedProcess:
    return run_python(["-m", "dspine_train.export", str(source), str(out), "--format", "dspine",
                       *extra], file_size_limit=file_size_limit)


def test_export_onto_a_target_model_is_refused_and_the_target_untouched(world, tmp_path):
    """Old code: exit 0 "wrote dspine draft", the target's weights and tokenizer gone."""
    import shutil

    target = tmp_path / "target"
    shutil.copytree(world["target"], target)
    before = tree(target)
    assert {"tokenizer.json", "model.safetensors", "config.json"} <= set(before)
    done = export(world["draft"], target)
    one_error_line(done, "OUT_DIR", str(target), "not written by dspine_train.export")
    assert done.returncode == 2
    assert tree(target) == before


@pytest.mark.parametrize("where", ["parent", "inside", "same"])
def test_export_overlapping_its_source_is_refused_and_the_source_survives(world, tmp_path,
                                                                          where):
    """Old code: exporting `src/sub` into `src` deleted the source."""
    import shutil

    holder = tmp_path / "src"
    source = holder / "sub"
    shutil.copytree(world["draft"], source)
    shutil.copy(world["draft"] / "config.json", holder)  # the parent looks like an export too
    before = tree(holder)
    out = {"parent": holder, "inside": source / "new" / "out", "same": source}[where]
    done = export(source, out)
    one_error_line(done, "OUT_DIR", "overlaps SRC_DIR", str(source))
    assert tree(holder) == before


def test_export_replaces_its_own_export_and_an_unmarked_draft_export(world, tmp_path):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(world["draft"], out)  # a draft export without the marker (older ones)
    done = export(world["draft"], out)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / ".dspine_train.export").is_file()
    done = export(world["draft"], out)  # marked now
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no lock file, no build


def test_a_second_export_into_the_same_directory_is_refused_by_name(world, tmp_path):
    """Old code: both exports reported success, one silently replacing the other."""
    out = tmp_path / "out"
    with held_elsewhere(out) as pid:
        done = export(world["draft"], out)
    one_error_line(done, "OUT_DIR", str(out), "in use by another run", f"pid {pid}",
                   "since", "command:")
    assert not out.exists()


def test_export_on_a_full_disk_keeps_the_old_export_and_says_so(world, tmp_path):
    """Old code: a SafetensorError traceback."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(world["draft"], out)
    before = tree(out)
    weights = (out / "model.safetensors").stat().st_size
    done = export(world["draft"], out, file_size_limit=weights // 2)
    line = one_error_line(done, f"OUT_DIR {out}", "File too large", "EFBIG",
                          f"the old output in {out} is intact")
    assert done.returncode == 1, line
    assert tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ----------------------------------------------------------------------------- token table
def test_token_table_into_the_target_is_refused_before_reading_it(world, tmp_path, capsys):
    """Old code: `--out T/model.safetensors` overwrote the target's weights, exit 0."""
    import shutil

    from dspine_train.token_table import main

    target = tmp_path / "target"
    shutil.copytree(world["target"], target)
    before = tree(target)
    for out in (target / "model.safetensors", target / "codes" / "table.safetensors"):
        assert main(["--target", str(target), "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: --out: {out} overlaps --target {target}"), err
    assert tree(target) == before


def test_token_table_replaces_its_own_table_only(world, tmp_path, capsys):
    from dspine_train.token_table import main

    foreign = tmp_path / "weights.safetensors"
    shutil_copy = (world["target"] / "model.safetensors").read_bytes()
    foreign.write_bytes(shutil_copy)
    argv = ["--target", str(world["target"]), "--transfer-dim", "8", "--out"]
    assert main([*argv, str(foreign)]) == 2
    err = capsys.readouterr().err
    assert "not written by dspine_train.token_table" in err and str(foreign) in err
    assert foreign.read_bytes() == shutil_copy
    table = tmp_path / "table.safetensors"
    assert main([*argv, str(table)]) == 0
    assert main([*argv, str(table)]) == 0  # its own table: rebuilt in place


# ----------------------------------------------------------------------------- engine CLI
@pytest.mark.parametrize("where", ["draft_weights", "in_target", "prompts", "foreign"])
def test_engine_output_onto_an_input_is_refused_before_loading(world, tmp_path, capsys,
                                                               where):
    """Old code: `--output DRAFT/model.safetensors` replaced the draft's weights with JSON, and
    `--output` equal to the prompts file replaced the prompts (exit 0)."""
    import shutil

    from dspine_train.engine.cli import main

    draft = tmp_path / "draft"
    shutil.copytree(world["draft"], draft)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w1 w2\n")
    foreign = tmp_path / "notes.json"
    foreign.write_text('{"mine": 1}\n')
    before = {**tree(tmp_path), **tree(world["target"])}
    output = {"draft_weights": draft / "model.safetensors",
              "in_target": world["target"] / "results.json", "prompts": prompts,
              "foreign": foreign}[where]
    code = main(["--target", str(world["target"]), "--draft", str(draft), "--prompts",
                 str(prompts), "--no-chat", "--max-new-tokens", "2", "--output", str(output)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(f"error: --output: {output} "), err
    assert ("not written by the engine" if where == "foreign" else "overlaps --") in err
    assert {**tree(tmp_path), **tree(world["target"])} == before


# ----------------------------------------------------------------------------- eval_acceptance
def _eval_acceptance():
    """The module holding `dspine-train eval`'s main (`scripts/eval_acceptance.py` calls it),
    whose `evaluate` the tests replace."""
    from dspine_train.evaluation import cli

    return cli


@pytest.mark.parametrize("where", ["file", "in_draft", "foreign_results"])
def test_eval_acceptance_out_is_checked_before_evaluating(world, tmp_path, capsys,
                                                          monkeypatch, where):
    """Old code: onto a file it evaluated for minutes, then FileExistsError (results lost);
    inside a draft export it wrote its results there (which push_to_hub uploads)."""
    import shutil

    module = _eval_acceptance()

    def evaluate(*args, **kwargs):
        raise AssertionError("evaluated before checking --out")

    monkeypatch.setattr(module, "evaluate", evaluate)
    draft = tmp_path / "draft"
    shutil.copytree(world["draft"], draft)
    out = {"file": tmp_path / "results.txt", "in_draft": draft / "eval",
           "foreign_results": tmp_path / "mine"}[where]
    if where == "file":
        out.write_text("keep me\n")
    if where == "foreign_results":
        out.mkdir()
        (out / "results.json").write_text('{"mine": 1}\n')
    before = tree(tmp_path)
    code = module.main(["--target", str(world["target"]), "--draft", str(draft),
                        "--bench", "humaneval", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err.startswith("error: --out") and str(out) in err, err
    assert {"file": "not a directory", "in_draft": "overlaps --draft",
            "foreign_results": "not written by eval_acceptance.py"}[where] in err
    assert tree(tmp_path) == before


def test_a_second_evaluation_into_the_same_out_is_refused(world, tmp_path, capsys,
                                                          monkeypatch):
    module = _eval_acceptance()
    monkeypatch.setattr(module, "evaluate", lambda *a, **k: pytest.fail("evaluated"))
    out = tmp_path / "eval"
    with held_elsewhere(out) as pid:
        code = module.main(["--target", str(world["target"]), "--draft", str(world["draft"]),
                            "--bench", "humaneval", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 1 and f"--out: {out} is in use by another run: pid {pid}" in err, err


# ----------------------------------------------------------------------------- data_prep
def tokenize_args(tokenizer: Path, inputs: Path, out: Path, hydra_dir: Path) -> list[str]:
    return ["-m", "data_prep.tokenize", f"data.tokenize.tokenizer_path={tokenizer}",
            f"data.tokenize.input_paths=[{inputs}]", f"data.tokenize.output_dir={out}",
            "data.tokenize.eval_fraction=0.3", f"hydra.run.dir={hydra_dir}"]


@pytest.fixture(scope="module")
def conversations(tmp_path_factory) -> dict[str, Path]:
    """A chat tokenizer and 400 conversations (a tokenised output of some 100 KB)."""
    from _data_helpers import QWEN3_TEMPLATE, chat_row, word_level_tokenizer, write_jsonl

    root = tmp_path_factory.mktemp("conversations")
    words = ["question", "answer", "ok"] + [str(i) for i in range(40)]
    word_level_tokenizer(QWEN3_TEMPLATE, words).save_pretrained(root / "tok")
    rows = [chat_row(f"r{i}", f"question {i % 40} " * 8, f"answer {i % 40} ok " * 8)
            for i in range(400)]
    return {"tok": root / "tok", "rows": write_jsonl(root / "rows.jsonl", rows)}


def test_tokenize_on_a_full_disk_over_its_output_keeps_it_and_says_so(conversations, tmp_path):
    """Old code: a `DatasetGenerationError` traceback (datasets wraps the failed write)."""
    out = tmp_path / "tokenized"
    args = tokenize_args(conversations["tok"], conversations["rows"], out, tmp_path / "hydra")
    first = run_python(args)
    assert first.returncode == 0, first.stderr[-2000:]
    before = tree(out)
    done = run_python([*args, "data.tokenize.seed=1"], file_size_limit=16 * 1024)
    one_error_line(done, f"data.tokenize.output_dir {out}", "EFBIG",
                   f"the old output in {out} is intact")
    assert tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hydra", "tokenized"]


def test_a_second_tokenize_into_the_same_directory_is_refused(conversations, tmp_path):
    """Old code: both runs reported success, one output silently replacing the other."""
    out = tmp_path / "tokenized"
    with held_elsewhere(out) as pid:
        done = run_python(tokenize_args(conversations["tok"], conversations["rows"], out,
                                        tmp_path / "hydra"))
    one_error_line(done, "data.tokenize.output_dir", f"in use by another run: pid {pid}")
    assert not out.exists()


def cache_args(assets: dict[str, Path], tmp_path: Path, features: Path) -> list[str]:
    return ["recipe=tiny", f"output_dir={tmp_path / 'run'}",
            f"model.target_path={assets['target']}", f"data.train_path={assets['data']}",
            f"model.token_table_path={assets['token_table']}", "logging.progress_bar=false",
            f"data.offline_features_dir={features}", f"hydra.run.dir={tmp_path / 'hydra'}"]


def test_cache_features_on_a_full_disk_keeps_the_old_cache_and_says_so(tiny_assets, tmp_path):
    """Old code: a `SafetensorError` traceback, and a cache half new (train replaced, eval
    not) when the disk filled on the second split."""
    from hydra import compose, initialize_config_dir

    from dspine_train.training.cache_features import cache_features
    from tests._train_helpers import single_thread

    features = tmp_path / "features"
    args = cache_args(tiny_assets, tmp_path, features)
    with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=args[:-1])
    with single_thread():
        cache_features(cfg)
    before = tree(features)
    largest = max(p.stat().st_size for p in features.rglob("*.safetensors"))
    done = run_python(["-m", "dspine_train.training.cache_features", *args, "seed=1"],
                      file_size_limit=largest // 2)
    one_error_line(done, f"data.offline_features_dir {features}", "EFBIG",
                   f"the old output in {features} is intact")
    assert tree(features) == before
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name] == []


def test_a_second_feature_cache_run_into_the_same_directory_is_refused(tiny_assets, tmp_path):
    features = tmp_path / "features"
    with held_elsewhere(features) as pid:
        done = run_python(["-m", "dspine_train.training.cache_features",
                           *cache_args(tiny_assets, tmp_path, features)])
    one_error_line(done, "data.offline_features_dir", f"in use by another run: pid {pid}")
    assert not features.exists()


# ----------------------------------------------------------------------------- train.py
def test_a_second_training_run_into_the_same_output_dir_is_refused(tiny_assets, tmp_path):
    """Old code: two runs with one output_dir gave a traceback and a "done" run whose
    metrics.jsonl held the other's steps."""
    from tests._train_helpers import run_train, tiny_overrides

    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("the first run's\n")
    with held_elsewhere(out) as pid:
        done = run_train(tiny_overrides(tiny_assets, out, "optim.max_steps=2"))
    one_error_line(done, "output_dir:", str(out), f"in use by another run: pid {pid}",
                   "command:")
    # nothing written: not even Hydra's record of the run's config and its log
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_training_refuses_a_foreign_final_directory_before_training(tiny_assets, tmp_path):
    """Old code: the run trained, then replaced `output_dir/final` whatever it held."""
    from tests._train_helpers import run_train, tiny_overrides

    out = tmp_path / "run"
    (out / "final").mkdir(parents=True)
    (out / "final" / "notes.txt").write_text("not an export\n")
    done = run_train(tiny_overrides(tiny_assets, out, "optim.max_steps=2"))
    one_error_line(done, "output_dir:", str(out / "final"), "not written by the trainer's export")
    assert tree(out / "final") == {"notes.txt": b"not an export\n"}
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
    assert not lock_path(out).exists()  # released as the refused run exited


def test_every_process_of_a_launched_run_stops_on_a_held_lock(tiny_assets, tmp_path):
    """Only rank 0 takes the lock; the run stops as a whole (the launcher ends the other
    ranks), instead of leaving them waiting for a rank 0 that is gone."""
    from tests._train_helpers import run_train, tiny_overrides

    out = tmp_path / "run"
    launch = ["--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no"]
    with held_elsewhere(out) as pid:
        done = run_train(tiny_overrides(tiny_assets, out, "optim.max_steps=2"), launch=launch,
                         timeout=240)
    assert done.returncode != 0
    assert f"error: output_dir: {out} is in use by another run: pid {pid}" in done.stderr, \
        done.stderr[-3000:]
    assert not out.exists()


def test_the_trainer_locks_its_output_dirs_on_the_main_process_only(tmp_path):
    """`Trainer` (also without Hydra, e.g. the study) locks `output_dir` and an outside
    `checkpoint.dir` before it writes; a non-main process takes no lock."""
    from types import SimpleNamespace

    from dspine_train.training.errors import TrainingError
    from dspine_train.training.run_lock import lock_run_outputs, release_run_outputs

    config = SimpleNamespace(output_dir=str(tmp_path / "run"),
                             checkpoint=SimpleNamespace(dir=str(tmp_path / "ckpt")))
    main = SimpleNamespace(is_main_process=True, num_processes=1)
    with held_elsewhere(tmp_path / "ckpt") as pid:
        with pytest.raises(TrainingError, match=rf"checkpoint\.dir: .* pid {pid} "):
            lock_run_outputs(config, main)
        assert not lock_path(tmp_path / "run").exists()  # the first lock was given back
        other = SimpleNamespace(is_main_process=False, num_processes=1)
        assert lock_run_outputs(config, other) == []
    taken = lock_run_outputs(config, main)
    assert taken == [tmp_path / "run", tmp_path / "ckpt"]
    release_run_outputs(taken)
    assert not lock_path(tmp_path / "run").exists()
