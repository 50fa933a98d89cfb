"""The demo: synthetic "shapes" datasets and the evaluations that read their
vocabulary. Not part of the product: training/, checkpoint/, parallel/ and
models/ never import it; the registry names its default-dataset builders and
evaluators as dotted strings, imported only when a run uses them
(``data.path: null``, the shapes evaluators)."""
