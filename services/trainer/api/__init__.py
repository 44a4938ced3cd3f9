"""HTTP routers of the trainer service (thin: logic lives behind protocols)."""
