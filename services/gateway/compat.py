"""Enforce the request-field contract of compat_table.py: a field polyserve does not honour is
refused with a 400 naming it (unless its value asks for nothing), a field ignored on purpose
passes, and a field the table does not know is accepted, as vLLM's server accepts it, logged
once per endpoint and named in the `X-Polyserve-Ignored-Fields` response header.

`python -m polyserve.gateway.compat [--check] [FILE]`, run in the checkout, writes (or checks)
the generated part of FILE (default docs/openai-compatibility.md)."""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from .compat_table import ENDPOINTS, ENGINES, HONOURED, IGNORED, MESSAGE, REFUSED, TABLES, Rule
from .policy import InvalidRequest

logger = logging.getLogger(__name__)
IGNORED_HEADER = "X-Polyserve-Ignored-Fields"
_logged: set[tuple[str, str]] = set()


def given(body: BaseModel) -> dict[str, Any]:
    """The fields the client sent: declared ones it set, and every extra one."""
    out = {name: getattr(body, name) for name in body.model_fields_set}
    out.update(body.model_extra or {})
    return out


def is_noop(value: Any, noop: tuple) -> bool:
    """`value` is one of the no-op values (a bool never equals a number here)."""
    return any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in noop)


def refuse(name: str, rule: Rule, engine: str) -> InvalidRequest:
    return InvalidRequest(f"'{name}' is not supported by polyserve ({rule.why_for(engine)}); leave it out "
                          "or send its default (docs/openai-compatibility.md)", name, code="unsupported_parameter")


def _unknown(endpoint: str, names: list[str]) -> None:
    for name in names:
        if (endpoint, name) not in _logged:
            _logged.add((endpoint, name))
            logger.warning("%s: request field '%s' is not in polyserve's compatibility table; accepted and "
                           "ignored (logged once)", ENDPOINTS[endpoint][0], name)


def check_fields(endpoint: str, fields: dict[str, Any], engine: str, table: dict[str, Rule] | None = None,
                 prefix: str = "") -> list[str]:
    """Raise InvalidRequest for the first refused field; return the unknown ones (logged once)."""
    table = TABLES[endpoint] if table is None else table
    unknown = []
    for name, value in fields.items():
        rule = table.get(name)
        if rule is None:
            unknown.append(prefix + name)
        elif rule.status_for(engine) == REFUSED and not is_noop(value, rule.noop):
            raise refuse(prefix + name, rule, engine)
    _unknown(endpoint, unknown)
    return unknown


def check(endpoint: str, body: BaseModel, engine: str) -> list[str]:
    """The fields of `body` against the table for `engine`; the endpoint's own rules too."""
    unknown = check_fields(endpoint, given(body), engine)
    if endpoint in ("completions", "chat"):
        _check_sampling(body)
    if endpoint == "chat":
        for i, msg in enumerate(body.messages):
            unknown += _check_message(i, msg, engine)
    return unknown


def _check_sampling(body: BaseModel) -> None:
    if body.ignore_eos and body.stop:
        raise InvalidRequest("'ignore_eos' cannot be combined with 'stop' in polyserve (it generates to "
                             "max_tokens by holding back EOS and stop strings alike)", "ignore_eos",
                             code="unsupported_parameter")


def _check_message(i: int, msg: BaseModel, engine: str) -> list[str]:
    fields = {k: v for k, v in given(msg).items() if k not in ("role", "content")}
    unknown = check_fields("chat", fields, engine, MESSAGE, prefix=f"messages[{i}].")
    if isinstance(msg.content, list):
        for j, part in enumerate(msg.content):
            if part.get("type") != "text":
                raise InvalidRequest(f"messages[{i}].content[{j}] is a '{part.get('type')}' part; polyserve "
                                     "serves text only", f"messages[{i}].content", code="unsupported_parameter")
    return unknown


def ignored_header(unknown: list[str]) -> dict[str, str]:
    return {IGNORED_HEADER: ",".join(unknown)} if unknown else {}


# ---------------------------------------------------------------------------- the document
DOC = "docs/openai-compatibility.md"
BEGIN, END = "<!-- BEGIN GENERATED: python -m polyserve.gateway.compat -->", "<!-- END GENERATED -->"
_MARK = {HONOURED: "honoured", REFUSED: "**400**", IGNORED: "ignored"}


def _cell(rule: Rule, engine: str, served: tuple[str, ...]) -> str:
    return _MARK[rule.status_for(engine)] if engine in served else "—"


def _notes(rule: Rule) -> str:
    text = rule.why
    if rule.status == REFUSED:
        ok = ", ".join("null" if v is None else repr(v).replace("'", '"').replace("True", "true")
                       .replace("False", "false") for v in rule.noop)
        text += f" (accepted: {ok})"
    for engine, (status, why) in rule.engines.items():
        text += f"; {engine}: {status} ({why})"
    return text.replace("|", "\\|")


def render_tables() -> str:
    """The generated part of the document: one table per endpoint, one column per engine."""
    out = []
    for endpoint, table in (*TABLES.items(), ("chat messages", MESSAGE)):
        path, served = ENDPOINTS.get(endpoint, ENDPOINTS["chat"])
        title = f"`{path}`" if endpoint in ENDPOINTS else "`messages[i]` of `POST /v1/chat/completions`"
        out += [f"### {title}", "", "| field | " + " | ".join(ENGINES) + " | how / why |",
                "|---|" + "---|" * len(ENGINES) + "---|"]
        for name, rule in table.items():
            cells = " | ".join(_cell(rule, e, served) for e in ENGINES)
            out.append(f"| `{name}` | {cells} | {_notes(rule)} |")
        out.append("")
    return "\n".join(out)


def document(current: str) -> str:
    """`current` with its generated part replaced by render_tables()."""
    head, _, rest = current.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n\n{render_tables()}\n{END}{tail}"


def main(argv: list[str]) -> int:
    doc = Path(next((a for a in argv if not a.startswith("--")), DOC))
    current = doc.read_text()
    fresh = document(current)
    if "--check" in argv:
        if fresh != current:
            print(f"{doc} is out of date: run python -m polyserve.gateway.compat", file=sys.stderr)
            return 1
        return 0
    doc.write_text(fresh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
