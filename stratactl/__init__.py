"""stratactl: the operator's tool for Strata."""
