"""Tools agents can call: document search, a safe calculator, HTTP GET, and user tools."""
