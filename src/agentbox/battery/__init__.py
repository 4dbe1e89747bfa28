"""Checks of agentbox from the outside: host inventories, the escape battery, reliability."""
