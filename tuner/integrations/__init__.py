"""Framework integrations: thin adapters from a framework's loop to the same in-job sessions."""
