"""Small stdlib-only helpers shared by the framework, the tools and the
scheduler (which imports nothing else of the framework but the control
client and the metrics schema, so these modules import no torch and no
other part of the package)."""
