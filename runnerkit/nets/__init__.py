"""Networks more than one family runs (each family keeps its own names for them in
`models/<family>/`); no family is named here (test_cases/runners/test_base.py)."""
