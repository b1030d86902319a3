"""The tests' helpers live in the package (kda_dhu.testing) so that ``python -m kda_dhu``
can run the same CPU check; this module keeps ``from helpers import ...`` working."""

from kda_dhu.testing import GATES, make_inputs, naive_bwd_dhu  # noqa: F401
