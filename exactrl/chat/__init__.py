"""Token-exact multi-turn chat: prefix splicing, monotonicity policy, tool-call parsing, trajectories."""
from exactrl.chat.messages import InconsistentTokenFieldsError, TokenFields, validate_tools
from exactrl.chat.parsing import ParsedAssistant, StreamParser, ToolCall, parse_assistant_text
from exactrl.chat.splice import POLICIES, MonotonicityError, PromptPlan, Splicer
from exactrl.chat.trajectory import Session, Trajectory

__all__ = ["InconsistentTokenFieldsError", "MonotonicityError", "POLICIES", "ParsedAssistant", "PromptPlan",
           "Session", "Splicer", "StreamParser", "TokenFields", "ToolCall", "Trajectory", "parse_assistant_text",
           "validate_tools"]
