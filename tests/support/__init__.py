"""What the tests share that is not a fixture: helpers, constants and test doubles.

Test modules import these; none imports another test module or a conftest (the fixtures
live in the conftests: tests/conftest.py for those of more than one tier, else the tier's
own). tests/unit/test_layout.py holds the suite to that.
"""
