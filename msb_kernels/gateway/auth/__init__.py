"""Who is asking (identity.py) and what they may do (authorizer.py): jupyter_server's auth hooks, as in its auth/."""
