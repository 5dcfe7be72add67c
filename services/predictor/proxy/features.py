"""Cheap prompt features for the fast predictor tier (issue 17), numpy only.

Two families, both computed in well under a millisecond on one core:

* **lexical / structural** (`lexical`): length in characters, words, lines and tokens;
  share of non-ASCII, CJK, digits, upper case and code punctuation; code fences and code
  keywords; question marks and the leading question word; instruction words that set an
  answer's length ("list", "explain", "essay", "story", "one word", "brief", "in detail",
  "step by step", "translate", "rewrite", ...); a requested count of items ("give 5 ideas",
  "ten examples") and a requested word budget ("in 100 words"); the share of the prompt
  after its first blank line (the input of an instruction); dialogue turns.
* **static token embeddings** (`StaticEmbedder`): the mean of the encoder's *input*
  embedding rows (all-MiniLM-L6-v2's 30,522 x 384 table, no transformer layers) over the
  prompt's head and, separately, its last 32 tokens (so a question after long code still
  counts), each projected to `dims` principal components fitted on training prompts
  (model2vec-style). Long prompts are cut to their first 3,000 and last 1,000 characters
  before tokenizing (head + tail).
"""
from __future__ import annotations

import re

import numpy as np

from polyserve.predictor.proxy.lexicon import count_groups

HEAD_CHARS, TAIL_CHARS, TAIL_TOKENS = 3000, 1000, 32

KEYWORDS: tuple[tuple[str, str], ...] = (
    ("list", r"\blist\b|\benumerate\b|\bbullet"),
    ("explain", r"\bexplain|\bdescribe|\bdiscuss|\belaborate"),
    ("essay", r"\bessay|\barticle|\bblog|\breport\b|\bspeech"),
    ("story", r"\bstory|\bpoem|\bsong|\blyrics|\bscript\b|\bscene|\bdialog"),
    ("letter", r"\bemail|\be-mail|\bletter\b|\bcover letter|\bmessage\b"),
    ("write", r"\bwrite\b|\bcompose|\bdraft\b|\bcreate\b|\bgenerate"),
    ("summary", r"\bsummar|\btl;?dr|\bin short\b"),
    ("translate", r"\btranslat"),
    ("rewrite", r"\brewrite|\bparaphrase|\brephrase|\bcorrect\b|\bproofread|\bedit\b|\bfix\b"),
    ("classify", r"\bclassif|\bcategori|\bsentiment|\blabel\b|\bwhich of\b|\bchoose\b|\bselect\b"),
    ("extract", r"\bextract|\bidentify|\bfind\b|\bpick out"),
    ("yesno", r"\byes or no\b|\btrue or false\b|\bis it\b|\bdoes it\b|\bcan you\b"),
    ("oneword", r"\bone word\b|\bsingle word\b|\bone sentence\b|\bsingle sentence\b|\bone line\b|\bnumber only\b"),
    ("brief", r"\bbrief|\bshort\b|\bconcise|\bsuccinct|\bquick\b|\bfew words\b|\bsimple\b"),
    ("detail", r"\bdetail|\bcomprehensive|\bthorough|\bin depth\b|\bin-depth\b|\bextensive|\bmuch detail"),
    ("steps", r"\bstep[- ]by[- ]step|\bsteps\b|\bhow to\b|\bguide\b|\btutorial|\binstructions\b"),
    ("compare", r"\bcompare|\bdifference|\bvs\.?\b|\bversus|\bpros and cons|\badvantages"),
    ("code", r"\bcode\b|\bprogram|\bfunction\b|\bscript\b|\bimplement|\bpython|\bjava\b|\bjavascript|\bsql\b|"
             r"\bc\+\+|\bregex|\bhtml|\bclass\b|\balgorithm"),
    ("math", r"\bcalculate|\bsolve\b|\bcompute|\bequation|\bprove\b|\bprobability|\bhow many\b|\bhow much\b|"
             r"\bsum of\b|\d\s*[-+*/^=]\s*\d"),
    ("examples", r"\bexamples?\b|\bideas?\b|\bsuggestions?\b|\btips\b|\bways\b|\breasons\b|\bnames?\b"),
    ("plan", r"\bplan\b|\bitinerary|\bschedule|\boutline|\bstrategy|\bproposal|\bagenda"),
    ("title", r"\btitle\b|\bheadline|\bslogan|\btagline|\btweet|\bcaption"),
    ("define", r"\bdefine\b|\bdefinition|\bwhat is\b|\bwhat are\b|\bmeaning of\b|\bwho is\b|\bwho was\b"),
    ("opinion", r"\bopinion|\bthink\b|\bfeel\b|\bwould you\b|\bdo you\b|\byour favorite"),
    ("roleplay", r"\bpretend|\bact as\b|\bimagine\b|\brole|\byou are a\b|\byou are an\b|\bas a\b"),
    ("refuse", r"\bkill|\bsteal|\bdrugs?\b|\bweapon|\bhack|\billegal|\bracist|\bsex"),
    ("joke", r"\bjoke|\briddle|\bpun\b|\bfunny"),
    ("table", r"\btable\b|\bcsv\b|\bjson\b|\bformat\b|\bmarkdown"),
)
QUESTION_WORDS = ("what", "why", "how", "who", "when", "where", "which", "is", "are", "can", "do", "does",
                  "should", "could", "would", "will", "explain", "write", "give", "list", "describe", "tell",
                  "create", "generate", "please", "i", "you", "the")
NUMBER_WORDS = {w: i for i, w in enumerate(("zero one two three four five six seven eight nine ten eleven twelve "
                                            "thirteen fourteen fifteen sixteen seventeen eighteen nineteen "
                                            "twenty").split())}
ITEM_NOUNS = (r"(?:ideas?|examples?|ways?|tips|reasons?|items?|questions?|names?|things|steps|points|words|"
              r"sentences?|paragraphs?|facts|options|suggestions?|benefits|lines|bullet points|jokes|titles|"
              r"strategies|methods|features|characters|places|books|movies|songs|recipes|activities|"
              r"synonyms|adjectives|verbs|nouns|keywords|tweets|slogans|headlines|questions|alternatives)")
_COUNT = re.compile(r"\b(\d{1,3}|" + "|".join(NUMBER_WORDS) + r")\s+(?:\w+\s+){0,2}?" + ITEM_NOUNS + r"\b")
_WORD_BUDGET = re.compile(r"\b(?:in|under|within|less than|fewer than|at most|no more than|about|around|up to)?"
                          r"\s*(\d{1,4})\s*(?:-|to)?\s*(?:\d{1,4}\s*)?words?\b")
_KW = [(name, re.compile(rx)) for name, rx in KEYWORDS]
_LATIN_EXT = re.compile("[\u00c0-\u024f]")
_CYRILLIC = re.compile("[\u0400-\u04ff]")
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]")
_CODE_CHARS = re.compile(r"[{}();=<>\[\]_#$\\|]")
_CODE_KW = re.compile(r"\bdef |\bimport |\breturn\b|#include|\bpublic |\bconst |\bvar |\blet |\bfunction\s*\(|"
                      r"\bSELECT\b|\bprint\(|=>|</")
_TURN = re.compile(r"(?:^|\n)\s*(?:Human|Assistant|User|USER|ASSISTANT|Q|A):", re.M)
_USER_TURN = re.compile(r"(?:^|\n)\s*(?:Human|User|USER):\s*", re.M)
_ASSISTANT_CUE = re.compile(r"\s*(?:Assistant|ASSISTANT):\s*$")
_WORD = re.compile(r"\w+", re.U)

LEXICAL_NAMES: tuple[str, ...] = (
    "log_chars", "log_words", "log_lines", "log_tokens", "frac_nonascii", "frac_cjk", "frac_digit", "frac_upper",
    "frac_codechar", "code_fence", "code_keywords", "questions", "ends_question", "first_word",
    "requested_items", "word_budget", "input_share", "log_first_line", "turns", "log_longest_line",
    "log_last_turn", "frac_latin_ext", "frac_cyrillic",
) + tuple(f"kw_{name}" for name, _ in KEYWORDS) + tuple(f"kw_{name}_head" for name, _ in KEYWORDS[:18])


def _log(x: float) -> float:
    return float(np.log1p(max(0.0, x)))


def requested_items(text: str) -> float:
    """The largest item count the prompt asks for ("5 ideas", "ten examples"); 0 when none."""
    best = 0
    for m in _COUNT.finditer(text):
        g = m.group(1)
        n = NUMBER_WORDS.get(g, None) if not g.isdigit() else int(g)
        if n is not None and n <= 200:
            best = max(best, n)
    return float(best)


def word_budget(text: str) -> float:
    """A word budget stated in the prompt ("in 100 words"); 0 when none."""
    m = _WORD_BUDGET.search(text)
    return float(m.group(1)) if m else 0.0


def last_user_turn(text: str) -> str | None:
    """The last user turn of a dialogue ("Human: ... Assistant: ... Human: ..."), None if not one."""
    starts = [m.end() for m in _USER_TURN.finditer(text)]
    if not starts:
        return None
    turn = text[starts[-1]:]
    nxt = re.search(r"\n\s*(?:Assistant|ASSISTANT):", turn)
    return turn[:nxt.start()] if nxt else turn


def lexical(prompt: str, n_tokens: int) -> np.ndarray:
    """The lexical/structural features of one prompt, in `LEXICAL_NAMES` order."""
    text = prompt if len(prompt) <= HEAD_CHARS + TAIL_CHARS else prompt[:HEAD_CHARS] + "\n" + prompt[-TAIL_CHARS:]
    low = text.lower()
    n = max(1, len(text))
    words = _WORD.findall(low)
    lines = text.split("\n")
    first, _, rest = text.strip().partition("\n\n")
    # the instruction: the first paragraph (in a dialogue: the last user turn, what the reply answers);
    # keywords there weigh more than in pasted input or earlier turns
    last = last_user_turn(text)
    head = (last if last is not None else first).lower()
    head_words = _WORD.findall(head)
    first_word = head_words[0] if head_words else (words[0] if words else "")
    fw = QUESTION_WORDS.index(first_word) + 1 if first_word in QUESTION_WORDS else 0
    vals = [
        _log(len(prompt)), _log(len(words)), _log(len(lines)), _log(n_tokens),
        sum(c > "\x7f" for c in text) / n, len(_CJK.findall(text)) / n, sum(c.isdigit() for c in text) / n,
        sum(c.isupper() for c in text) / n, len(_CODE_CHARS.findall(text)) / n,
        float("```" in text), float(len(_CODE_KW.findall(text))), float(text.count("?") + text.count("？")),
        float(_ASSISTANT_CUE.sub("", text).rstrip().endswith(("?", "？"))), float(fw), requested_items(low),
        word_budget(low),
        len(rest) / n, _log(len(first)), float(len(_TURN.findall(text))),
        _log(max((len(x) for x in lines), default=0)),
        _log(len(last if last is not None else first)),
        len(_LATIN_EXT.findall(text)) / n, len(_CYRILLIC.findall(text)) / n,
    ]
    # English keywords, plus the same requests in nine other languages (`lexicon`) in the same feature
    cjk = vals[5] > 0
    other, other_head = count_groups(words, low, cjk), count_groups(head_words, head, cjk)
    # max, not sum: a foreign stem that is also an English word ("detail") must not count twice
    vals += [float(max(len(rx.findall(low)), other.get(name, 0))) for name, rx in _KW]
    vals += [float(bool(other_head.get(name)) or bool(rx.search(head))) for name, rx in _KW[:18]]
    return np.asarray(vals, dtype=np.float32)


def clip_text(prompt: str) -> str:
    """Head + tail of a long prompt (what gets tokenized), without a dialogue's trailing
    "Assistant:" cue (so the tail embedding is the user's last words)."""
    prompt = _ASSISTANT_CUE.sub("", prompt) if prompt.rstrip().endswith(":") else prompt
    if len(prompt) <= HEAD_CHARS + TAIL_CHARS:
        return prompt
    return prompt[:HEAD_CHARS] + "\n" + prompt[-TAIL_CHARS:]


class StaticEmbedder:
    """Mean input-embedding of a prompt's tokens (and of its last `TAIL_TOKENS`), projected.

    `table` is the encoder's word-embedding matrix already multiplied by the projection
    (vocab x dims), so a prompt costs one gather and one mean."""

    def __init__(self, table: np.ndarray):
        self.table = np.ascontiguousarray(table, dtype=np.float32)
        self.dims = self.table.shape[1]

    @staticmethod
    def word_embeddings(encoder_dir) -> np.ndarray:
        """The encoder's input embedding table (vocab x hidden), read without torch."""
        from pathlib import Path

        from safetensors import safe_open

        path = Path(encoder_dir) / "model.safetensors"
        with safe_open(str(path), framework="np") as f:
            key = next(k for k in f.keys() if k.endswith("word_embeddings.weight"))
            return f.get_tensor(key).astype(np.float32)

    def __call__(self, ids: list[int]) -> np.ndarray:
        if not ids:
            return np.zeros(2 * self.dims, dtype=np.float32)
        rows = self.table[ids]
        return np.concatenate([rows.mean(axis=0), rows[-TAIL_TOKENS:].mean(axis=0)])


def fit_projection(table: np.ndarray, token_lists: list[list[int]], dims: int, seed: int = 0) -> np.ndarray:
    """PCA directions (hidden x dims) of the mean raw embeddings of training prompts."""
    rng = np.random.default_rng(seed)
    pick = rng.choice(len(token_lists), size=min(len(token_lists), 8000), replace=False)
    means = np.stack([table[token_lists[i]].mean(axis=0) if token_lists[i] else np.zeros(table.shape[1])
                      for i in pick])
    means = means - means.mean(axis=0)
    _, _, vt = np.linalg.svd(means, full_matrices=False)
    return vt[:dims].T.astype(np.float32)
