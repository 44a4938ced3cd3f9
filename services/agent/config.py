"""Settings of the agent service (env prefix ``TANDEM_AGENT_``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from services.agent.reader.select import PASSAGE
from services.common.ratelimit import TenantLimitSettings


class AgentSettings(TenantLimitSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_AGENT_", extra="ignore")

    model: str = Field(
        "",
        description="Model name asked of the inference service; empty uses the first model it lists.",
    )
    tokenizer: str = Field(
        "",
        description=(
            "Hugging Face tokenizer folder used to count prompt tokens; empty counts with a conservative "
            "estimate (one token per 3 UTF-8 bytes)."
        ),
    )
    context_tokens: int = Field(
        2048, ge=256, description="Context window of the model, in tokens (prompt plus answer)."
    )
    max_answer_tokens: int = Field(
        256, ge=1, description="Tokens reserved for (and at most generated in) an answer."
    )
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="Sampling temperature of answers.")
    top_p: float | None = Field(
        None, gt=0.0, le=1.0, description="Nucleus sampling of answers; empty (or 1) samples from all tokens."
    )
    grounding_guard: bool = Field(
        True,
        description=(
            "Check chat answers against their sources: a degenerate answer (empty, repeated, a bare "
            "preamble, nothing supported) is replaced by the best source sentences with citations, "
            "unsupported sentences of the rest are flagged."
        ),
    )
    grounding_embedder: bool = Field(
        True,
        description=(
            "The groundedness guard also judges the sentences word overlap misses with the "
            "collection's own embedder (retrieval's /embed); off, or when that fails: "
            "word overlap only."
        ),
    )
    reader: str = Field(
        "tandem-reader",
        description=(
            "What picks the source sentences answering a question: a reader model served by "
            "inference's /v1/rerank (the default `tandem-reader`: the collections' embedder tuned "
            "by the trainer's `reader` job on the tuning question sets' candidate sentences, "
            "published by `tandem reader train`, which `make up` starts when it is missing; it "
            "states the most answers on the held-out sets, benchmarks/RESULTS.md), `features` (the "
            "learned scorer shipped with the agent, also what answers while a named reader is not "
            "served), or empty: the embedder and lexical rules alone. A pipeline's answer step or "
            "a tenant's promoted reader may name another."
        ),
    )
    answer_passage: int = Field(
        PASSAGE,
        ge=0,
        le=5,
        description=(
            "Sentences of the source either side of the best one that an extractive answer carries "
            "(0: the best sentence alone, with only the neighbours it cannot be read without). A "
            "manual often restates a question in one sentence and answers it in the next; chosen "
            'on the tuning question sets (benchmarks/RESULTS.md, "thirteen document sets").'
        ),
    )
    reader_threshold: float | None = Field(
        None,
        ge=-1.0,
        le=1.0,
        description=(
            "A sentence answers when the reader scores it at least this (a cross-encoder's "
            "probability, a bi-encoder's cosine, as /v1/rerank gives them); unset (the default), "
            "the reader orders the sentences and the rules say whether any answers, which measured "
            'fewer false "not found" on the held-out sets than any one threshold. A tenant\'s '
            "promoted reader uses the threshold its own held-out rows chose."
        ),
    )
    top_k: int = Field(5, ge=1, le=100, description="Chunks retrieved for chat-documents.")
    min_relevance: float = Field(
        0.25,
        ge=0.0,
        le=1.0,
        description=(
            "Below this relevance (dense cosine when the retrieval service reports one, else the share of "
            "query words found in the chunk) a chunk is not used as context."
        ),
    )
    pipelines_dir: str = Field(
        "", description="Folder with extra pipeline definitions (*.yaml, *.yml, *.json) loaded at start."
    )
    agent_max_steps: int = Field(6, ge=1, le=50, description="Most reasoning steps of one agent run.")
    agent_time_budget_s: float = Field(60.0, gt=0, description="Wall-clock budget of one agent run.")
    tool_timeout_s: float = Field(10.0, gt=0, description="Longest a single tool call may run.")
    tool_calling: Literal["react", "openai"] = Field(
        "openai",
        description="How agents call tools: OpenAI tool calls (the default: they solve more tasks on SmolLM2-135M, "
        "17/20 tool tasks against ReAct's 13/20, benchmarks/RESULTS.md), or the strict ReAct text protocol. "
        "When the inference service refuses tools (an upstream without them), an agent run falls back to ReAct.",
    )
    search_tool_top_k: int = Field(
        1,
        ge=1,
        le=20,
        description="Passages the agents' document_search tool returns. One by default: SmolLM2-135M "
        "answers from the best passage far more often than from three (python -m benchmarks.agent --tool-tasks).",
    )
    http_tool_enabled: bool = Field(
        False, description="Offer the HTTP GET tool to agents (it refuses private and loopback addresses)."
    )
    http_tool_max_bytes: int = Field(200_000, ge=1024, description="Largest body the HTTP GET tool reads.")
    tool_side_effects: Literal["refuse", "approve"] = Field(
        "refuse",
        description="What agents do with tools that have side effects (http_get; MCP tools their server "
        "does not mark readOnlyHint): 'refuse' does not offer them to the model; 'approve' pauses the run "
        "at such a call with an approval_required event until a person approves or denies it "
        "(POST /v1/agents/approvals/{id}). A document or tool result can tell the model to call them.",
    )
    approval_ttl_s: int = Field(
        900,
        ge=10,
        le=7 * 24 * 3600,
        description="Seconds a held tool call (approval_required) may be approved or denied; later a "
        "decision is a 410.",
    )
    memory_ttl_s: int = Field(7 * 24 * 3600, ge=60, description="Seconds a conversation lives after use.")
    memory_max_messages: int = Field(
        100, ge=2, description="Messages kept per conversation (oldest dropped first)."
    )
    memory_max_conversations: int = Field(
        200, ge=1, description="Conversations kept per user (least recently used dropped first)."
    )
    max_message_chars: int = Field(16_000, ge=1, description="Longest user message accepted.")
    ws_max_frame_bytes: int = Field(
        64 * 1024, ge=1024, description="Largest websocket frame accepted; bigger ones get an error event."
    )
    upstream_timeout_s: float = Field(
        120.0, gt=0, description="Timeout of calls to the retrieval and inference services."
    )
    web_dist: str = Field(
        "", description="Folder of the built web front end; empty uses services/agent/web/dist."
    )
    feedback_max_correction_chars: int = Field(
        8000, ge=1, description="Longest correction (a rewritten answer) accepted with feedback."
    )
    regenerate_temperature: float = Field(
        0.8,
        gt=0.0,
        le=2.0,
        description="Sampling temperature of a regenerated draft (sampled, so it differs from the answer).",
    )
    dataset_min_rows_kto: int = Field(
        4, ge=1, description="Fewest rows a KTO dataset built from feedback may have (both labels needed)."
    )
    dataset_min_rows_dpo: int = Field(
        2, ge=1, description="Fewest rows a DPO dataset built from feedback may have."
    )
    dataset_min_rows_sft: int = Field(
        2, ge=1, description="Fewest rows an SFT dataset built from feedback may have."
    )
    dataset_min_rows_pairs: int = Field(
        2,
        ge=1,
        description="Fewest (question, cited chunk) pairs an embedder dataset built from feedback may have.",
    )
    promotion_margin: float = Field(
        0.05,
        ge=0.0,
        le=1.0,
        description="How much worse (a share, on any metric of either set) a fine-tune from feedback may "
        "answer than the model it would replace and still be promoted to the tenant's chat default.",
    )
    promotion_holdout: float = Field(
        0.2,
        ge=0.0,
        lt=1.0,
        description="Share of the answers rated up or corrected that training on feedback holds out as "
        "the tenant's regression set (chosen by a hash of the message id, so every round holds out the same).",
    )
    promotion_eval_max: int = Field(
        40, ge=1, le=1000, description="Most held-out answers a fine-tune is evaluated on (the newest)."
    )
    promotion_recent: int = Field(
        20, ge=0, le=1000, description="Recent questions of the tenant a fine-tune is also evaluated on."
    )
    promotion_probe_questions: int = Field(
        10,
        ge=0,
        le=1000,
        description="Regression questions the gate also asks reworded to mislead (a fixed set of rewordings "
        "each; the candidate must not do worse on them by more than the margin). 0: no such probe.",
    )
    feedback_rows_per_key: int = Field(
        200,
        ge=1,
        description="Ratings and choices a training set from feedback counts per contributor: per user "
        "(a person, all of its tokens together) or per API key that is no user's; the first it gave. "
        "Later ones are stored but not counted (the set's left_out says so), so one account cannot "
        "steer the tenant's model.",
    )
    promotion_poll_s: float = Field(
        5.0, gt=0, description="How often the agent looks for finished fine-tunes from feedback to evaluate."
    )
    mcp_allow_private: bool = Field(
        False,
        description="Let tenants register MCP servers on private, loopback or link-local addresses "
        "(off: such a server URL is a 400, and is checked again before every call).",
    )
    mcp_timeout_s: float = Field(
        10.0, gt=0, description="Longest one MCP call (connect, list or call) may take."
    )
    mcp_max_response_bytes: int = Field(
        1 << 20, ge=1024, description="Largest answer read from an MCP server (one HTTP response)."
    )
    mcp_max_servers: int = Field(20, ge=1, description="MCP servers one tenant may register.")
    mcp_allowed_hosts: str = Field(
        "",
        description="Comma-separated extra Host names the agent's /mcp answers (`name`, `name:port` or "
        "`name:*`), besides loopback, TANDEM_HOST:TANDEM_AGENT_PORT and TANDEM_AGENT_URL's host; a "
        "browser Origin must be http(s):// one of them. Others get 421 (Host) or 403 (Origin): a DNS "
        "rebinding guard.",
    )
    mcp_secret_key: str = Field(
        "",
        description="Fernet key that encrypts registered MCP servers' header values; empty uses (and "
        "creates) $TANDEM_HOME/agent/mcp-secret.key. Set the same key on every agent replica.",
    )
    eval_max_questions: int = Field(
        1000, ge=1, le=10_000, description="Most questions one evaluation set may hold (413 beyond it)."
    )
    eval_max_runs: int = Field(
        50, ge=1, le=1000, description="Evaluation runs kept per set (the oldest go first)."
    )
    eval_concurrency: int = Field(
        2, ge=1, le=32, description="Questions of one evaluation run answered at the same time."
    )
    eval_judge_url: str = Field(
        "",
        description="OpenAI-compatible server (its /v1 root) of the model that judges evaluation answers "
        "when a run names a judge_model; empty: the inference service, with the caller's key.",
    )
    eval_judge_api_key: str = Field(
        "", description="Bearer key sent to TANDEM_AGENT_EVAL_JUDGE_URL (empty: none)."
    )

    @field_validator("mcp_allowed_hosts")
    @classmethod
    def _host_names(cls, value: str) -> str:
        for host in (h.strip() for h in value.split(",")):
            if host and ("/" in host or any(c.isspace() for c in host)):
                raise ValueError(
                    f"must be host names (name, name:port or name:*) separated by commas, got {host!r}"
                )
        return value

    def mcp_allowed_host_list(self) -> list[str]:
        return [h.strip() for h in self.mcp_allowed_hosts.split(",") if h.strip()]
