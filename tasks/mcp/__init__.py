"""Remote MCP servers: the requester side of the MCP Tasks extension and its configuration."""
