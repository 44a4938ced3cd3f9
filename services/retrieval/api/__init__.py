"""HTTP routers of the retrieval service (thin: logic lives behind protocols)."""
