"""policy=auto: one search over every technique (issue 23); see planners/auto/search.py."""
