"""The settings table (``settings``), the rules that check it, and byte sizes."""
