"""Procedurally generated, seeded tasks whose shared context is an affix (DESIGN §5)."""
