"""Shared-memory building blocks of the L2 tier (see :mod:`kvcomm.tiers.l2`)."""
