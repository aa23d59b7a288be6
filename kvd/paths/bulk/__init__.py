"""The bulk TCP path: a binary protocol that streams values from and into pool pages."""
