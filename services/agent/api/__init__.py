"""HTTP routers of the agent service (thin: logic lives behind protocols)."""
