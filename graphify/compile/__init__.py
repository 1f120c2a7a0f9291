"""torch.compile inside graphs (`Options(compile=...)`): compiled functions kept as long as
their graphs (`compiled`, `code_claims`), saved whole for later processes (`aot`,
`aot_store`), the graph rewrites adapters register (`rewrites`), and the compile in another
process while plain graphs serve (`background`)."""
