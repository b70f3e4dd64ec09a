"""Token-exact multi-turn chat: prefix splicing, monotonicity policy, tool-call parsing, trajectories."""

from exactrl.chat.messages import InconsistentTokenFieldsError, TokenFields, validate_tools
from exactrl.chat.parsing import (
    HERMES,
    LLAMA3_JSON,
    TOOL_FORMATS,
    ParsedAssistant,
    StreamParser,
    ToolCall,
    parse_assistant_text,
)
from exactrl.chat.splice import POLICIES, MonotonicityError, PromptPlan, Splicer
from exactrl.chat.trajectory import Session, Trajectory

__all__ = [
    "HERMES",
    "InconsistentTokenFieldsError",
    "LLAMA3_JSON",
    "MonotonicityError",
    "POLICIES",
    "ParsedAssistant",
    "PromptPlan",
    "Session",
    "Splicer",
    "StreamParser",
    "TOOL_FORMATS",
    "TokenFields",
    "ToolCall",
    "Trajectory",
    "parse_assistant_text",
    "validate_tools",
]
