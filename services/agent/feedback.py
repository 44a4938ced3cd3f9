"""Feedback into training datasets (issue 13): KTO, DPO and SFT rows from turn records.

Every row's prompt is the exact list of messages the model saw when it answered
(the turn record), so a fine-tune trains on what it will be served. Shapes
(CONTRACT.md, the trainer's formats):

- ``kto``: ``{"prompt": [messages], "completion": str, "label": bool}``: every
  rated answer with its rating's label, and every correction as a desirable
  completion;
- ``dpo`` (``preference``): ``{"prompt": [messages], "chosen": str, "rejected": str}``:
  corrections (chosen = the correction, rejected = the original answer) and
  chosen drafts (chosen over the other draft of the same prompt);
- ``sft`` (``messages``): ``{"messages": [...prompt, {"role": "assistant", ...}]}``:
  thumbs-up answers and corrections;
- ``pairs`` (an embedder job's, issue 17): ``{"query": str, "positive": str, "document_id": str}``:
  the question of each thumbs-up answer with each chunk the answer cites (its title opening its
  text, as the retrieval service embeds a chunk), and the document it comes from.

Every row also names who gave the feedback it comes from (``key_id``: a person's user id, the
same for all of its tokens, or the id of a tenant key; the trainer ignores the field). Each
such contributor counts for at most ``feedback_rows_per_key`` ratings and choices of a training
set, the first it gave; the rest stay stored but are not counted (``over_cap``), so one account
cannot steer the tenant's model however fast it rates (OWASP LLM04, data poisoning). A set says
whose feedback it left out, how much and why (``left_out``).

A set also names the collections its rows' answers came from (``collections``): a fine-tune
trained on it is served only to people who may read all of them (services/agent/model_access.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from services.agent.config import AgentSettings
from services.agent.model_choice import held_out
from services.agent.protocol import Choice, DatasetFormat, Feedback, FeedbackCreate, LeftOut, TurnRecord
from services.agent.quality import QualityMetrics
from services.agent.turns import FeedbackFilter, FeedbackRow, PreferenceRow, TurnStore, owner_scope
from services.common.auth import Principal, refuse_viewer
from services.common.errors import InvalidRequest, NotFound, PayloadTooLarge

# The trainer job type of each dataset format.
JOB_TYPE: dict[str, str] = {"kto": "kto", "dpo": "dpo", "sft": "sft", "pairs": "embedder"}
# A person's feedback is recorded under its user id (services/common/users.py makes them
# ``u_<hex>``); a tenant key's under the key id, which is hex alone.
USER_ID_PREFIX = "u_"


def contributor_kind(owner: str) -> Literal["user", "key"]:
    return "user" if owner.startswith(USER_ID_PREFIX) else "key"


# -- feedback and preferences (the HTTP routes and the websocket both write them) ------------------


def feedback_object(fb: FeedbackRow, rec: TurnRecord) -> Feedback:
    return Feedback(
        message_id=fb.message_id,
        rating=fb.rating,
        correction=fb.correction,
        comment=fb.comment,
        pipeline=rec.pipeline,
        model=rec.model,
        collection=rec.collection,
        question=rec.question,
        answer=rec.answer,
        conversation_id=rec.conversation_id,
        draft_of=rec.draft_of,
        created_at=fb.created_at,
        updated_at=fb.updated_at,
        key_id=fb.key_id or None,
    )


class FeedbackWriter:
    """Feedback and preferences on the turn records in ``turns``, each thumb counted in
    ``quality``'s metrics, within ``settings``' limits."""

    def __init__(self, turns: TurnStore, quality: QualityMetrics, settings: AgentSettings) -> None:
        self.turns = turns
        self.quality = quality
        self.settings = settings

    async def turn_of(self, principal: Principal, message_id: str, param: str) -> TurnRecord:
        """The record, if the caller may see it: a member's own, any of the tenant's for an admin.
        Another key's record is a 404 like a missing one, so a member learns nothing of it."""
        record = await self.turns.get_turn(principal.tenant, message_id, owner_scope(principal))
        if record is None:
            raise NotFound(f"no message {message_id!r}", param=param)
        return record

    async def give(self, principal: Principal, body: FeedbackCreate) -> Feedback:
        """Records or replaces the caller's feedback on one of its tenant's messages."""
        refuse_viewer(principal, "feedback")  # the websocket's feedback frames come here too
        limit = self.settings.feedback_max_correction_chars
        if body.correction is not None and len(body.correction) > limit:
            raise PayloadTooLarge(
                f"correction has {len(body.correction)} characters; the limit is {limit}", param="correction"
            )
        if body.correction is not None and not body.correction.strip():
            raise InvalidRequest(
                "correction is empty: leave it out, or write the answer it should have been",
                param="correction",
            )
        record = await self.turn_of(principal, body.message_id, "message_id")
        fb = await self.turns.set_feedback(
            principal.tenant, body.message_id, body.rating, body.correction, body.comment, principal.key_id
        )
        if record.quality is not None and record.quality.rating != body.rating:
            # A new thumb, or one turned over; the same thumb given again is not counted twice.
            self.quality.observe_rating(principal.tenant, record.pipeline, record.quality.model, body.rating)
        out = feedback_object(fb, record)
        before = await self.turns.given_before(principal.tenant, principal.key_id, fb.created_at)
        out.counted = before < self.settings.feedback_rows_per_key
        return out

    async def choose(self, principal: Principal, message_id: str, over: str) -> Choice:
        """Records a preference pair: ``message_id`` chosen over ``over``, two drafts of one prompt."""
        refuse_viewer(principal, "choosing a draft (feedback)")
        chosen = await self.turn_of(principal, message_id, "message_id")
        if over == message_id:
            raise InvalidRequest(
                f"over: {over!r} is the chosen message itself; name the other draft", param="over"
            )
        rejected = await self.turn_of(principal, over, "over")
        if (chosen.draft_of or chosen.message_id) != (rejected.draft_of or rejected.message_id):
            raise InvalidRequest(
                f"over: {over!r} is not a draft of the same prompt as {message_id!r} "
                "(regenerate an answer to get drafts to choose from)",
                param="over",
            )
        await self.turns.add_preference(principal.tenant, message_id, over, principal.key_id)
        return Choice(chosen=message_id, rejected=over)


# -- datasets ------------------------------------------------------------------------------------


@dataclass
class Capped:
    """The feedback a training set draws on, each key's first ``cap`` ratings and choices."""

    feedback: list[tuple[FeedbackRow, TurnRecord]]
    preferences: list[PreferenceRow]
    cap: int
    over_cap: dict[str, int] = field(default_factory=dict)  # per key: ratings and choices not counted


def cap_per_key(
    feedback: list[tuple[FeedbackRow, TurnRecord]], preferences: list[PreferenceRow], cap: int
) -> Capped:
    """Each key's first ``cap`` ratings and choices (in the order given; a rating changed later
    keeps its place), the rest left out and counted in ``over_cap``."""
    given: list[tuple[float, str, int, str]] = [
        (fb.created_at, fb.message_id, i, fb.key_id) for i, (fb, _) in enumerate(feedback)
    ]
    given += [
        (p.created_at, f"{p.chosen.message_id}>{p.rejected.message_id}", -1 - i, p.key_id)
        for i, p in enumerate(preferences)
    ]
    seen: dict[str, int] = {}
    kept: set[int] = set()
    over: dict[str, int] = {}
    for _, _, index, key_id in sorted(given):
        seen[key_id] = seen.get(key_id, 0) + 1
        if seen[key_id] <= cap:
            kept.add(index)
        else:
            over[key_id] = over.get(key_id, 0) + 1
    return Capped(
        feedback=[pair for i, pair in enumerate(feedback) if i in kept],
        preferences=[p for i, p in enumerate(preferences) if -1 - i in kept],
        cap=cap,
        over_cap=over,
    )


@dataclass
class BuiltDataset:
    format: DatasetFormat
    rows: list[dict[str, Any]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    models: set[str] = field(default_factory=set)
    held_out: list[str] = field(default_factory=list)  # message ids kept out as the regression set
    cap: int | None = None  # ratings and choices counted per key
    over_cap: dict[str, int] = field(default_factory=dict)
    excluded_keys: list[str] = field(default_factory=list)
    collections: set[str] = field(default_factory=set)  # of the answers its rows come from

    def left_out(self) -> list[LeftOut]:
        """Whose feedback the set does not count, and why."""
        out = [
            LeftOut(
                contributor=owner,
                kind=contributor_kind(owner),
                reason="over_cap",
                ratings_and_choices=count,
                detail=f"{count} ratings and choices past the cap of {self.cap} per "
                f"{contributor_kind(owner)} (the first {self.cap} it gave are counted)",
            )
            for owner, count in sorted(self.over_cap.items())
        ]
        out += [
            LeftOut(
                contributor=owner,
                kind=contributor_kind(owner),
                reason="excluded",
                detail="named in exclude_keys: none of its feedback is counted",
            )
            for owner in self.excluded_keys
        ]
        return out

    def contributors(self) -> dict[str, int]:
        """Rows per key that gave their feedback."""
        out: dict[str, int] = {}
        for row in self.rows:
            key_id = str(row.get("key_id", ""))
            out[key_id] = out.get(key_id, 0) + 1
        return out

    def jsonl(self) -> bytes:
        return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in self.rows).encode()


def corrected_completion(record: TurnRecord, correction: str) -> str:
    """The completion the model should have written, given the answer the user should have seen.

    For a pipeline both are the same text. An agent's raw completion wraps the visible
    answer ("Thought: ...\\nFinal Answer: <answer>"): the correction replaces the answer
    inside it, so the row keeps the format the agent's prompt asks for.
    """
    if record.answer and record.completion != record.answer:
        at = record.completion.rfind(record.answer)
        if at >= 0:
            return record.completion[:at] + correction + record.completion[at + len(record.answer) :]
    return correction


def rated_completion(record: TurnRecord) -> str:
    """The completion a rating is about: what the user saw. When the groundedness guard showed
    source sentences instead of the model's text (``answer_kind == "extractive"``), a thumbs up
    approves those sentences, with their ``[n]`` markers, so they are what the model should learn
    to write; the raw completion the user never saw is not what the rating judged. Likewise a
    "not found" (``answer_kind == "not_found"``, no model call: ``completion`` is empty): the
    rating judges the "Your documents do not say ..." the user saw, and a correction of it is the
    answer the model should have written from the recorded prompt."""
    if record.answer_kind in ("extractive", "not_found") and record.answer.strip():
        return record.answer
    return record.completion


def _usable(record: TurnRecord) -> bool:
    """Only answers a model wrote from a recorded prompt can train it."""
    return bool(record.prompt) and bool(record.model)


def _prompt(record: TurnRecord) -> list[dict[str, Any]]:
    return [{"role": str(m.get("role")), "content": str(m.get("content") or "")} for m in record.prompt]


def build_dataset(
    fmt: DatasetFormat,
    feedback: list[tuple[FeedbackRow, TurnRecord]],
    preferences: list[PreferenceRow],
    holdout: float = 0.0,
) -> BuiltDataset:
    """``holdout``: the share of chat answers rated up or corrected kept out of the rows (the
    tenant's regression set, services/agent/promotions.py); counted as ``held_out``."""
    out = BuiltDataset(fmt)
    counts = dict.fromkeys(_COUNT_NAMES[fmt], 0)
    rated = sorted(feedback, key=lambda pair: pair[1].created_at)
    for fb, rec in rated:
        before = len(out.rows)
        if fmt == "pairs":
            _add_pairs(out, counts, fb, rec)
        else:
            _add_rated(out, counts, fb, rec, holdout)
        if len(out.rows) > before and rec.collection:
            out.collections.add(rec.collection)
    if fmt == "dpo":
        for pref in preferences:
            if not (_usable(pref.chosen) and _usable(pref.rejected)):
                continue
            if pref.chosen.completion.strip() == pref.rejected.completion.strip():
                continue  # two identical drafts teach nothing
            out.rows.append(
                {
                    "prompt": _prompt(pref.chosen),
                    "chosen": pref.chosen.completion,
                    "rejected": pref.rejected.completion,
                    "key_id": pref.key_id,
                }
            )
            counts["preferences"] += 1
            out.models.add(pref.chosen.model)
            out.collections.update(c for c in (pref.chosen.collection, pref.rejected.collection) if c)
    if holdout:
        counts["held_out"] = len(out.held_out)
    out.counts = counts
    return out


def _add_rated(
    out: BuiltDataset, counts: dict[str, int], fb: FeedbackRow, rec: TurnRecord, holdout: float
) -> None:
    """The rows of one rating (and its correction) in a kto, dpo or sft dataset."""
    fmt = out.format
    if not _usable(rec):
        return
    correction = (fb.correction or "").strip()
    if rec.kind == "pipeline" and (fb.rating == 1 or correction) and held_out(rec.message_id, holdout):
        out.held_out.append(rec.message_id)
        return
    if fmt == "kto":
        out.rows.append(
            {
                "prompt": _prompt(rec),
                "completion": rated_completion(rec),
                "label": fb.rating == 1,
                "key_id": fb.key_id,
            }
        )
        counts["desirable" if fb.rating == 1 else "undesirable"] += 1
        if correction:
            out.rows.append(
                {
                    "prompt": _prompt(rec),
                    "completion": corrected_completion(rec, correction),
                    "label": True,
                    "key_id": fb.key_id,
                }
            )
            counts["desirable"] += 1
            counts["corrections"] += 1
    elif fmt == "dpo":
        if correction and correction != rec.answer.strip():
            out.rows.append(
                {
                    "prompt": _prompt(rec),
                    "chosen": corrected_completion(rec, correction),
                    "rejected": rated_completion(rec),
                    "key_id": fb.key_id,
                }
            )
            counts["corrections"] += 1
    else:
        if correction:
            completion = corrected_completion(rec, correction)
            counts["corrections"] += 1
        elif fb.rating == 1:
            completion = rated_completion(rec)
            counts["thumbs_up"] += 1
        else:
            return
        out.rows.append(
            {
                "messages": [*_prompt(rec), {"role": "assistant", "content": completion}],
                "key_id": fb.key_id,
            }
        )
    out.models.add(rec.model)


def _add_pairs(out: BuiltDataset, counts: dict[str, int], fb: FeedbackRow, rec: TurnRecord) -> None:
    """A thumbs up says the cited chunks answered the question: each is a positive of it. A
    thumbs down says nothing about which chunk failed (the model may have misread a good one),
    so it gives no pair."""
    query = rec.question.strip()
    if fb.rating != 1 or not query:
        return
    seen: set[str] = set()
    added = 0
    for cite in rec.citations:
        text = str(cite.get("text") or "").strip()
        chunk = str(cite.get("chunk_id") or text)
        if not text or chunk in seen:
            continue
        seen.add(chunk)
        title = str(cite.get("title") or "").strip()
        row = {"query": query, "positive": f"{title}\n{text}" if title else text, "key_id": fb.key_id}
        if cite.get("document_id"):
            row["document_id"] = str(cite["document_id"])
        out.rows.append(row)
        added += 1
    if added:
        counts["thumbs_up"] += 1
        counts["pairs"] += added
        out.models.add(rec.model)


_COUNT_NAMES: dict[str, tuple[str, ...]] = {
    "kto": ("desirable", "undesirable", "corrections"),
    "dpo": ("corrections", "preferences"),
    "sft": ("thumbs_up", "corrections"),
    "pairs": ("thumbs_up", "pairs"),
}


def check_enough(built: BuiltDataset, min_rows: int, filt: FeedbackFilter) -> None:
    """Too little data is a 400 naming what was found and what is needed."""
    found = ", ".join(f"{k}={v}" for k, v in built.counts.items())
    scope = _describe_filter(filt)
    problems = []
    if len(built.rows) < min_rows:
        problems.append(f"{len(built.rows)} rows found, at least {min_rows} needed")
    if built.format == "kto":
        for label in ("desirable", "undesirable"):
            if built.counts[label] < 1:
                problems.append(f"no {label} rows found, at least 1 needed (KTO needs both labels)")
    if problems:
        raise InvalidRequest(
            f"too little feedback for a {built.format} dataset{scope}: {'; '.join(problems)} (found: {found})",
            param="format",
            code="not_enough_feedback",
        )


def _describe_filter(filt: FeedbackFilter) -> str:
    parts = [
        f"{name}={value!r}"
        for name, value in (("since", filt.since), ("pipeline", filt.pipeline), ("model", filt.model))
        if value is not None
    ]
    if filt.exclude_keys:
        parts.append(f"exclude_keys={sorted(filt.exclude_keys)!r}")
    return f" ({', '.join(parts)})" if parts else ""
