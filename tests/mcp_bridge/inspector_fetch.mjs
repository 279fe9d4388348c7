// Preloaded into the MCP Inspector CLI (node --import) by tests/mcp_bridge/test_inspector.py.
// The Inspector 0.15 has no option for request headers, so this adds the bearer token
// (MSB_TEST_BEARER_TOKEN) to its requests, as an HTTP MCP client set up with a token does.
// With MSB_TEST_FETCH_LOG it also records, per request, the JSON-RPC method, the
// MCP-Protocol-Version header sent and the Mcp-Session-Id header received: which era it spoke.
import { appendFileSync } from "node:fs";

const token = process.env.MSB_TEST_BEARER_TOKEN;
const log = process.env.MSB_TEST_FETCH_LOG;
const send = globalThis.fetch;

globalThis.fetch = async (input, init = {}) => {
  const headers = new Headers(init.headers ?? (input instanceof Request ? input.headers : undefined));
  if (token) headers.set("Authorization", `Bearer ${token}`);
  const response = await send(input, { ...init, headers });
  if (log) {
    let method = null;
    try { method = JSON.parse(init.body).method ?? null; } catch { /* a GET or DELETE has no JSON body */ }
    appendFileSync(log, JSON.stringify({
      http: init.method ?? "GET", method, status: response.status,
      protocol_version: headers.get("mcp-protocol-version"), session_id: response.headers.get("mcp-session-id"),
    }) + "\n");
  }
  return response;
};
