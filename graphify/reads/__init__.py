"""What a call reads beyond its arguments, and the per-call watch of it.

A capture walks what the function reaches (`walk`, `reach`: modules wherever they sit,
their parameters, hooks and attributes; the globals, closures and classes of the code that
ran, `code_ran`), and `watch` checks it before every replay in a microsecond or two
(`dict_marks` and its C helper, `parameter_storage`). `torch_settings` records the
process-wide settings kernels depend on; `stateful_types` registers objects whose Python
state graphs follow by branch; `snapshot` and `takeover` put state back and hand memory to a
new object of the same shapes.
"""
