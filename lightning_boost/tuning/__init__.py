"""Measurement and search, with no Lightning imports: worker tuning, RNG preservation, the JSON cache."""
