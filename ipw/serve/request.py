"""One metered request of ``ipw serve``, from its body to its record: the text a router scores, its query id,
what it was once it ended (``Ended``), and the energy its answer carries (``energy_object``)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
from dataclasses import dataclass
from typing import Any

from ipw.backends.base import Completion, QueryError
from ipw.results import QueryRecord
from ipw.telemetry.uncertainty import measurement_90

def routing_text(body: dict[str, Any]) -> str:
    """The text a router scores: a completion's prompt, or the contents of a chat's messages (text parts)."""
    if "messages" not in body:
        prompt = body.get("prompt", "")
        return prompt if isinstance(prompt, str) else ""
    parts = []
    for m in body.get("messages") or []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts += [c["text"] for c in content if isinstance(c, dict) and isinstance(c.get("text"), str)]
    return "\n".join(parts)


def prompt_digest(body: dict[str, Any]) -> tuple[str, str]:
    """A request's query id (the first 16 hex digits of the SHA-256 of its prompt: the same prompt
    pairs across runs) and its prompt as text (chat: the messages as JSON)."""
    prompt = body.get("messages") if "messages" in body else body.get("prompt", "")
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()[:16], text


def hashed(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()


def energy_object(record: QueryRecord, request_id: str, provisional: bool = False) -> dict[str, Any]:
    """``usage.energy`` of a response: its record's energy, labeled as the record is.  ``provisional``: the
    record holds the provisional energy given at the answer (``Meter.provisional``), whose ±90% band is
    ``uncertainty_j``; the settled value follows in the run folder and at ``settled_url`` (``request_id``: the
    request's random id, ``Ended.request_id``)."""
    out: dict[str, Any] = {
        "energy_j": record.energy_j, "net_energy_j": record.net_energy_j, "provisional": provisional,
        "quality": record.energy_quality, "source": record.energy_source, "scope": record.energy_scope,
    }
    if provisional:
        out["uncertainty_j"] = record.provisional_uncertainty_j  # ±90% around the settled value to come
    else:
        # the ± that the choice of split adds (|priced - local|); null when the request ran alone; the
        # sensors' own error is in measurement_uncertainty_j (±90%; docs/SERVING.md)
        out["uncertainty_j"] = record.split_uncertainty_j
        out["measurement_uncertainty_j"] = measurement_90(record.energy_j, record.energy_parts)
    out.update({"split_method": record.split_method or "none",
                "prompt_tokens": record.prompt_tokens, "completion_tokens": record.completion_tokens,
                "duration_s": round(record.end_s - record.start_s, 6), "request_id": request_id,
                "settled_url": f"/v1/ipw/energy/{request_id}"})
    return out


def with_override(record: QueryRecord, override: QueryError | None) -> QueryRecord:
    """``record`` with ``override`` as its error (the client went away after the request's end), if it had none."""
    if override is None or record.error is not None:
        return record
    return dataclasses.replace(record, error=f"QueryError: {override}", error_category=override.category)


UNSETTLED = "provisional"  # the energy source's prefix of a record whose energy never settled (pending.jsonl)


def unsettled(record: QueryRecord) -> QueryRecord:
    """A provisional record as the run folder keeps it until its settled one replaces it: its energy (the value
    the answer carried) labelled estimated, and its source ``provisional:...``, so that a folder read after a
    kill never shows it as settled or measured."""
    if record.energy_j is None:
        return record
    parts = [{**p, "quality": "estimated"} if str(p.get("quality", "")).startswith("measured") else p
             for p in json.loads(record.energy_parts)]
    return dataclasses.replace(record, energy_quality="estimated", energy_source=f"{UNSETTLED}:{record.energy_source}",
                               energy_parts=json.dumps(parts), phase_quality="estimated" if record.phase_quality else "",
                               provisional_energy_j=record.energy_j)


@dataclass
class Ended:
    """What a metered request was once it ended: its body, API, repeat, outcome and window; ``override``: an
    error that came after its end (the client went away while the answer was written)."""

    body: dict[str, Any]
    api: str
    repeat: int
    completion: Completion | None
    error: Exception | None
    window: tuple[float, float]
    override: QueryError | None = None
    route: str = ""  # with --route: "local" or "cloud" (the upstream it went to)
    on_disk: QueryRecord | None = None  # its record in pending.jsonl (``Session.answered``)
    # the id its answer carries, for its settled energy (``GET /v1/ipw/energy/ID``): random, so that it tells
    # nothing of the prompt (a hash of it would let any client test whether a given prompt was sent)
    request_id: str = dataclasses.field(default_factory=lambda: secrets.token_urlsafe(16))

