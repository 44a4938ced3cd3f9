"""Tool-using agents: a ReAct text protocol small models can drive, and OpenAI tool calls."""
