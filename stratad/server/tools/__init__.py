"""Function calling: the call types messages carry (`types`) and reading calls out of the
model's text, or forcing one with a grammar (`calls`)."""
