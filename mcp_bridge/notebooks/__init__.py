"""Notebook tools: the cells of a notebook a person has open in JupyterLab, edited and run live over its Y document."""
