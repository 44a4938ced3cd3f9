"""HTTP routers of the inference service (thin: logic lives behind protocols)."""
