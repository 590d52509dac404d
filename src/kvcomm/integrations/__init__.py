"""Integrations of KVCOMM with other frameworks, each behind its own extra.

* :mod:`kvcomm.integrations.langgraph` (``pip install 'kvcomm[langgraph]'``): a LangGraph
  checkpointer (``KVCommSaver``) and store (``KVCommStore``).
"""
