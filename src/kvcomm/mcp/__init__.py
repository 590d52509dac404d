"""KVCOMM for any agent: an MCP server (``kvcomm mcp``; docs/integrations/mcp.md).

:mod:`kvcomm.mcp.tools` holds the tools as plain functions over a client (the rules for
values, versions and watch cursors are in its docstring); :mod:`kvcomm.mcp.server` serves
them with the official MCP SDK (``pip install 'kvcomm[mcp]'``) on stdio or streamable HTTP.
"""
