"""Users import speculators_compat before speculators; so do these tests (on transformers 5,
`import speculators` itself needs the shim's speculators-import patch)."""

import speculators_compat  # noqa: F401  (activates the shim)
