"""The way out of a sandbox: an allow-list that kernels reach the network through, and secrets that never enter them.

With MSB_NETWORK_ALLOW (or a session's narrower list) a kernel's sandbox still has no route anywhere; its only way
out is a Unix socket in its io dir, where this process's egress proxy listens for that kernel alone. Inside, a small
relay (relay_program.py, started by the sandbox's init) offers the socket as an HTTP proxy on 127.0.0.1:3128, as a
DNS server on 127.0.0.1:53 that answers allowed names only, and on the allowed names' ports for tools that ignore
proxy variables. Outside, the proxy decides every connection by the kernel's policy:

- policy.py: the rules, a session's narrowing, and the addresses no rule opens;
- secrets.py: values a kernel sees only as placeholders, put into requests for their hosts by the proxy;
- dns.py: DNS messages (the relay's queries, and lookups for MSB_NETWORK_DNS);
- tls.py: a ClientHello's SNI, and the certificate authority the proxy signs with where it puts secrets into HTTPS;
- proxy.py: one kernel's connections, from the header the relay sends to the upstream's last byte;
- service.py: the proxy's thread and its listeners, one per kernel, and its counters.
"""
