"""The predictor's dataset: prompts, target model and true output length in tokens.

Sources (``../shared/datasets/text/``, see its README), one target model each:

* ``alpaca_eval/<model>.json``: the same 805 instructions answered by five models;
  the target model is the file's ``generator`` field.
* ``gpteacher/*.json``: GPT-4 answers (GPTeacher); target model ``gpteacher-gpt-4``.
* ``codealpaca/code_alpaca_2k.json``: text-davinci-003 answers (Code Alpaca);
  target model ``codealpaca-text-davinci-003``.

The prompt is ``instruction`` plus, when present, a blank line and ``input``.
Lengths (prompt and answer) are counted with the encoder's own tokenizer, by
default the all-MiniLM-L6-v2 WordPiece tokenizer (bert-base-uncased vocabulary),
without special tokens; they are *not* the target models' own token counts.

The split is **by prompt**: a row's split is a hash of its normalised prompt
text (lower case, collapsed white space) and the seed, so the same prompt text
is never in two splits, whichever model answered it, and adding data never
moves an existing prompt to another split.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
GPTEACHER_MODEL = "gpteacher-gpt-4"
CODEALPACA_MODEL = "codealpaca-text-davinci-003"


@dataclass(frozen=True, slots=True)
class Row:
    prompt: str
    model: str
    output_tokens: int
    input_tokens: int
    source: str
    split: str


@dataclass
class Dataset:
    rows: list[Row]
    data_hash: str
    tokenizer: str

    def split(self, name: str) -> list[Row]:
        return [r for r in self.rows if r.split == name]

    @property
    def models(self) -> list[str]:
        return sorted({r.model for r in self.rows})

    def save(self, path: str | Path) -> None:
        """JSON lines: a header line (hash, tokenizer), then one row per line."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as f:
            f.write(json.dumps({"data_hash": self.data_hash, "tokenizer": self.tokenizer,
                                "rows": len(self.rows)}) + "\n")
            for r in self.rows:
                f.write(json.dumps(asdict(r), ensure_ascii=False) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Dataset":
        with Path(path).open(encoding="utf-8") as f:
            head = json.loads(f.readline())
            rows = [Row(**json.loads(line)) for line in f if line.strip()]
        if len(rows) != head.get("rows", len(rows)):
            raise ValueError(f"{path}: header says {head['rows']} rows, found {len(rows)}")
        return cls(rows, head["data_hash"], head["tokenizer"])


def normalise(prompt: str) -> str:
    return re.sub(r"\s+", " ", prompt.strip().lower())


def split_of(prompt: str, seed: int = 0, val_frac: float = 0.1, test_frac: float = 0.1) -> str:
    """Deterministic split of a prompt text (same text -> same split)."""
    digest = hashlib.sha256(f"{seed}\0{normalise(prompt)}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2 ** 64
    return "test" if u < test_frac else "val" if u < test_frac + val_frac else "train"


def _prompt(instruction: str, inp: str | None) -> str:
    instruction, inp = (instruction or "").strip(), (inp or "").strip()
    return f"{instruction}\n\n{inp}" if inp else instruction


def source_files(text_dir: Path) -> list[Path]:
    files = sorted((text_dir / "alpaca_eval").glob("*.json")) + sorted((text_dir / "gpteacher").glob("*.json")) \
        + sorted((text_dir / "codealpaca").glob("*.json"))
    if not files:
        raise FileNotFoundError(f"no datasets under {text_dir} (expected alpaca_eval/, gpteacher/, codealpaca/)")
    return files


def read_examples(text_dir: Path) -> Iterator[tuple[str, str, str, str]]:
    """(prompt, answer, target model, source file) of every usable example."""
    for f in source_files(text_dir):
        rel = f"{f.parent.name}/{f.name}"
        for item in json.loads(f.read_text(encoding="utf-8")):
            if f.parent.name == "alpaca_eval":
                prompt, answer, model = _prompt(item["instruction"], None), item["output"], item["generator"]
            elif f.parent.name == "gpteacher":
                prompt, answer, model = _prompt(item["instruction"], item.get("input")), item["response"], \
                    GPTEACHER_MODEL
            else:
                prompt, answer, model = _prompt(item["instruction"], item.get("input")), item["output"], \
                    CODEALPACA_MODEL
            if prompt and answer is not None and model:
                yield prompt, answer, model, rel


def data_hash(files: Iterable[Path], tokenizer: str, seed: int, val_frac: float, test_frac: float) -> str:
    """sha256 of the source files, the tokenizer and the split parameters."""
    h = hashlib.sha256(f"{tokenizer}|{seed}|{val_frac}|{test_frac}".encode())
    for f in files:
        h.update(f"{f.parent.name}/{f.name}".encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def count_tokens(texts: list[str], tokenizer, batch: int = 512) -> list[int]:
    """Tokens per text, without special tokens."""
    out: list[int] = []
    for i in range(0, len(texts), batch):
        enc = tokenizer(texts[i:i + batch], add_special_tokens=False, truncation=False)
        out += [len(ids) for ids in enc["input_ids"]]
    return out


def build(text_dir: str | Path, tokenizer, tokenizer_name: str, *, seed: int = 0, val_frac: float = 0.1,
          test_frac: float = 0.1) -> Dataset:
    """Read every source, count lengths with `tokenizer`, assign splits by prompt."""
    text_dir = Path(text_dir)
    examples = list(read_examples(text_dir))
    prompts = [e[0] for e in examples]
    answers = [e[1] for e in examples]
    out_tok = count_tokens(answers, tokenizer)
    in_tok = count_tokens(prompts, tokenizer)
    rows = [Row(prompt=p, model=m, output_tokens=o, input_tokens=i, source=src,
                split=split_of(p, seed, val_frac, test_frac))
            for (p, _, m, src), o, i in zip(examples, out_tok, in_tok)]
    h = data_hash(source_files(text_dir), tokenizer_name, seed, val_frac, test_frac)
    logger.info("dataset: %d rows, %d models, hash %s", len(rows), len({r.model for r in rows}), h[:12])
    return Dataset(rows, h, tokenizer_name)


def summary(ds: Dataset) -> str:
    """Rows and distinct prompts per split and model, for the CLI."""
    lines = [f"data hash {ds.data_hash[:16]}  tokenizer {ds.tokenizer}"]
    for split in SPLITS:
        rows = ds.split(split)
        lines.append(f"{split:>5}: {len(rows):6d} rows, {len({normalise(r.prompt) for r in rows}):5d} prompts")
    for m in ds.models:
        lens = sorted(r.output_tokens for r in ds.rows if r.model == m)
        lines.append(f"  {m:<32} {len(lens):5d} rows  median output {lens[len(lens) // 2]} tokens")
    return "\n".join(lines)
