"""The shared training engine: one loop for every model family."""

import utils.quiet  # noqa: F401  (first: it silences known-harmless third-party warnings before they load)
