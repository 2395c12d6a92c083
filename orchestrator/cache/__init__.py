"""The content-addressed cache: store (entries, locks, publishing), code_keys (the modules a stage reaches through
its imports: its key's code), resume (an interrupted attempt continued under another key)."""
