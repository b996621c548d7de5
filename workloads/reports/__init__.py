"""How the benches' results are shown: percentiles, a bench report as Markdown, PNG plots."""
