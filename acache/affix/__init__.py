"""ACache: affixes anywhere in a prompt, their shared K/V store, anchor selectors, and generation."""
