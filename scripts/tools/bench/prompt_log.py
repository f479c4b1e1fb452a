"""The resumable record of a `bench_engine.py --compare` run: one JSON line per decoded prompt.

A side-by-side run on a CPU takes tens of minutes, so every prompt's results (all modes of that
prompt, decoded back to back under the same load) are appended to a JSON-lines log as soon as
the prompt is done. Rerunning the same command reads the log, skips the prompts it holds and
decodes only the rest; the report is built from the log, so a run interrupted at any point
loses at most the prompt in flight.

The log's first line holds the run's settings (target, draft, prompts, modes, budgets, seed).
A log written with other settings is refused by name rather than mixed into the figures.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from scripts.tools.bench.hf_reference import Decoded

# (temperature, round, benchmark, prompt index)
PromptKey = tuple[float, int, str, int]


class PromptLogError(ValueError):
    """The log cannot be resumed: unreadable, or written by a run with other settings."""


class PromptLog:
    """Per-prompt results of one run, appended as they come (module doc)."""

    def __init__(self, path: Path, settings: dict[str, Any]) -> None:
        self.path = path
        self.settings = json.loads(json.dumps(settings))  # as it reads back from JSON
        self.done: dict[PromptKey, dict[str, Decoded]] = {}
        if path.exists() and path.stat().st_size:
            self._read()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("w") as fh:
                fh.write(json.dumps({"settings": self.settings}) + "\n")

    def _read(self) -> None:
        lines = self.path.read_text().splitlines()
        try:
            head = json.loads(lines[0])["settings"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise PromptLogError(
                f"{self.path}: line 1 is not a --compare log header ({err}); "
                "remove the file or pass another --compare-log") from err
        changed = sorted(k for k in set(head) | set(self.settings)
                         if head.get(k) != self.settings.get(k))
        if changed:
            key = changed[0]
            raise PromptLogError(
                f"{self.path} was written with other settings ({', '.join(changed)}; {key}: "
                f"{head.get(key)!r} there, {self.settings.get(key)!r} now); remove it to start "
                "over or pass another --compare-log")
        for number, line in enumerate(lines[1:], start=2):
            try:
                rec = json.loads(line)
                key = (float(rec["temperature"]), int(rec["round"]), str(rec["bench"]),
                       int(rec["prompt"]))
                modes = {name: Decoded(**d) for name, d in rec["modes"].items()}
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                if number == len(lines):  # a line cut short by a kill: decode that prompt again
                    self._truncate(lines[: number - 1])
                    return
                raise PromptLogError(f"{self.path}: line {number} is not a prompt record; "
                                     "remove the file or pass another --compare-log") from None
            self.done[key] = modes

    def _truncate(self, lines: list[str]) -> None:
        self.path.write_text("".join(line + "\n" for line in lines))

    def get(self, key: PromptKey) -> dict[str, Decoded] | None:
        """Every mode's result of that prompt, if a previous run decoded it."""
        return self.done.get(key)

    def append(self, key: PromptKey, modes: dict[str, Decoded]) -> None:
        """Record one prompt's results (flushed before the next prompt starts)."""
        temperature, rnd, bench, prompt = key
        rec = {"temperature": temperature, "round": rnd, "bench": bench, "prompt": prompt,
               "modes": {name: asdict(d) for name, d in modes.items()}}
        with self.path.open("a") as fh:
            fh.write(json.dumps(rec) + "\n")
        self.done[key] = modes
