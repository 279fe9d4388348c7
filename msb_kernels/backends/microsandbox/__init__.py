"""The microVM wing: a microsandbox VM per kernel (backend.py) and the images it boots (images.py)."""
