"""What the simulated engines generate: prompts, response lengths and rewards, in blocks of tokens.

Tokens are not sampled. Each sample's response length is drawn once from a distribution and the sample
finishes there (or at the budget): the engine looks it up from the request, whose first input id is the
prompt's row in the dataset (the workload's `encode` puts it there) and whose id names the sample
(`EngineWorker` sends `<sample_id>@<step>`, `PromptSource` names samples `<group_id>s<index>`).

Lengths of the samples of one prompt are correlated: a normal score `z = sqrt(rho) z_prompt +
sqrt(1 - rho) z_sample` is mapped through the distribution's quantile function (rho =
`group_correlation`; hard prompts give long answers to every sample). Families: `lognormal` (median,
sigma), `pareto` (median as the scale x_m, alpha; as the countdown task's `task.length`), `histogram` (a
JSON file of measured lengths: a flat list, or per-prompt rows), `task` (the same file's per-prompt rows,
matched to the prompts of the real dataset by row; for the calibration).

Rewards are not simulated either. A finished sample gets reward 1 if it is its group's sample 0, else
0, so no group has uniform rewards and DAPO's dynamic filter keeps every group, except the
`filtered_fraction` of prompts whose samples all get 0 (the filter drops them, and the monitor refills).

A block is `block` tokens: with long responses the simulation counts in blocks (a 16,384-token budget
in 512 blocks of 32) and every figure it reports is converted back to tokens.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
from pathlib import Path
from statistics import NormalDist

from april_ray.task.data import Example
from april_ray.types import GenerateRequest

_NORMAL = NormalDist()


def _uniform(*key) -> float:
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") + 0.5) / 2.0 ** 64


def _normal(*key) -> float:
    return _NORMAL.inv_cdf(_uniform(*key))


def sample_index(sample_key: str) -> int | None:
    """The index of a sample in its group from its id (`<group_id>s<index>`), if it has that form."""
    head, _, tail = sample_key.rpartition("s")
    return int(tail) if head and tail.isdigit() else None


class LengthModel:
    """Response length in tokens of sample `sample_key` of prompt row `row` (before the budget cap)."""

    def __init__(self, family: str, median: float, sigma: float, rho: float, seed: int,
                 histogram: list[int] | None = None, rows: dict[int, list[int]] | None = None,
                 by_sample: dict[str, int] | None = None, alpha: float = 1.2):
        """`by_sample`: lengths of particular samples by id, taken before any draw (a calibration replays
        the lengths a benchmark's samples really had)."""
        if family not in ("lognormal", "pareto", "histogram", "task"):
            raise ValueError(f"response length family {family!r}: expected lognormal, pareto, histogram or task")
        if family == "histogram" and not histogram:
            raise ValueError("response length family histogram: no lengths given")
        if family == "task" and not rows:
            raise ValueError("response length family task: no per-prompt lengths given")
        self.family, self.median, self.sigma, self.rho, self.seed = family, median, sigma, rho, seed
        self.alpha = alpha
        self._shared, self._own = math.sqrt(rho), math.sqrt(1 - rho)
        self.sorted = sorted(histogram or [])
        self.rows = rows or {}
        self.row_keys = sorted(self.rows)
        self.by_sample = by_sample or {}

    def __call__(self, row: int, sample_key: str) -> int:
        """(Drawn once per sample: `Workload` keeps what it derives from it.)"""
        if sample_key in self.by_sample:
            return self.by_sample[sample_key]
        if self.family == "task":
            return self._measured(row, sample_key)
        z = self._shared * self._prompt_score(row) + self._own * _normal(self.seed, "sample", sample_key)
        if self.family == "lognormal":
            return max(1, int(round(self.median * math.exp(self.sigma * z))))
        if self.family == "pareto":  # Pareto(x_m, alpha)'s quantile, from the upper tail (exact far out)
            return max(1, int(round(self.median * _NORMAL.cdf(-z) ** (-1.0 / self.alpha))))
        return self.sorted[min(len(self.sorted) - 1, int(_NORMAL.cdf(z) * len(self.sorted)))]

    @functools.lru_cache(maxsize=1 << 16)
    def _prompt_score(self, row: int) -> float:
        return _normal(self.seed, "prompt", row)

    def _measured(self, row: int, sample_key: str) -> int:
        """The prompt's own measured lengths (another measured prompt's, by hash, if it was not measured)."""
        lengths = self.rows.get(row) or self.rows[self.row_keys[int(_uniform(self.seed, row) * len(self.row_keys))]]
        i = sample_index(sample_key)
        return lengths[(i if i is not None else int(_uniform(self.seed, sample_key) * 1e9)) % len(lengths)]

    def mean(self, num: int = 4096) -> float:
        """Mean length over `num` draws (one per prompt)."""
        return sum(self(r, f"mean{r}s0") for r in range(num)) / num


def load_lengths_file(path: str) -> tuple[list[int], dict[int, list[int]]]:
    """A JSON file: {"lengths": [...]} (one response length in tokens each) and/or {"by_row": {row: [...]}}
    (each prompt's samples, by dataset row). Bad content raises ValueError naming the file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"response lengths file {path}: {e}") from None
    flat = data.get("lengths", []) if isinstance(data, dict) else None
    by_row = data.get("by_row", {}) if isinstance(data, dict) else None
    if flat is None or not isinstance(flat, list) or not isinstance(by_row, dict) or not (flat or by_row):
        raise ValueError(f"response lengths file {path}: expected an object with a 'lengths' list or a 'by_row' map")
    rows = {}
    for k, v in by_row.items():
        if not isinstance(v, list) or not v:
            _fail(path, f"by_row[{k!r}]: expected a non-empty list of lengths, got {v!r:.40}")
        rows[_integer(path, f"by_row key {k!r}", k, 0)] = [_integer(path, f"by_row[{k!r}][{i}]", x) for i, x in enumerate(v)]
    flat = [_integer(path, f"lengths[{i}]", x) for i, x in enumerate(flat)] or [x for v in rows.values() for x in v]
    return flat, rows


def _fail(path: str, what: str):
    raise ValueError(f"response lengths file {path}: {what}")


def _integer(path: str, where: str, value, minimum: int = 1) -> int:
    """An integer of at least `minimum` (or a string of one, as JSON object keys are), else a ValueError
    naming the entry."""
    try:
        if isinstance(value, bool) or not isinstance(value, (int, str)) or int(value) < minimum:
            raise ValueError
        return int(value)
    except ValueError:
        _fail(path, f"{where}: expected an integer of at least {minimum}, got {value!r:.40}")


class Workload:
    """Prompts and answers of the simulation, in blocks of `block` tokens."""

    def __init__(self, lengths: LengthModel, prompt_lens: list[int], block: int, max_response_len: int,
                 filtered_fraction: float = 0.0, seed: int = 0):
        """`prompt_lens[row]`: prompt tokens of dataset row `row` (its length is the dataset's)."""
        self.lengths = lengths
        self.prompt_lens = prompt_lens
        self.block = block
        self.max_response_blocks = max_response_len // block
        self.filtered_fraction = filtered_fraction
        self.seed = seed

    def blocks(self, tokens: int) -> int:
        return max(1, -(-tokens // self.block))

    def examples(self) -> list[Example]:
        return [Example(row, str(row), "") for row in range(len(self.prompt_lens))]

    def encode(self, text: str) -> list[int]:
        row = int(text)
        return [row] + [0] * (self.blocks(self.prompt_lens[row]) - 1)

    def target(self, key: str, input_ids: list[int]) -> tuple[int, int]:
        """(blocks a request for sample `key` with `input_ids` has left before the sample's drawn end,
        uncapped; the token id they carry)."""
        total, token, prompt = self._drawn(input_ids[0], key)
        return total - (len(input_ids) - prompt), token

    @staticmethod
    def sample_key(request: GenerateRequest) -> str:
        """The sample a request is for: its id without `EngineWorker`'s `@<step>` tag."""
        return request.request_id.rpartition("@")[0] or request.request_id

    @functools.lru_cache(maxsize=1 << 18)  # looked up at every call that carries the sample
    def _drawn(self, row: int, key: str) -> tuple[int, int, int]:
        """(the sample's drawn length in blocks, the token id its blocks carry, its prompt's blocks)."""
        rewarded = sample_index(key) == 0 and not self.filtered(row)
        return self.blocks(self.lengths(row, key)), int(rewarded), self.blocks(self.prompt_lens[row])

    @functools.lru_cache(maxsize=1 << 16)
    def filtered(self, row: int) -> bool:
        """Whether every sample of this prompt gets reward 0 (the dynamic filter drops its groups)."""
        return _uniform(self.seed, "filter", row) < self.filtered_fraction

    def response_len(self, row: int, sample_key: str) -> int:
        """Blocks a sample ends with: its drawn length, capped by the budget."""
        return min(self._drawn(row, sample_key)[0], self.max_response_blocks)

    @staticmethod
    def decode(ids: list[int]) -> str:
        return "1" if ids and ids[-1] == 1 else "0"

    @staticmethod
    def reward(prompt: str, text: str, answer: str) -> float:
        return float(text == "1")
