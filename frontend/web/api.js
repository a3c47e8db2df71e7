// Calls to the server's own API, each carrying the key the user entered
// (kept in this browser's localStorage only, never sent anywhere else).

const KEY = "pagoda.apiKey";

export function apiKey() {
  return localStorage.getItem(KEY) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY, key);
  else localStorage.removeItem(KEY);
}

export function headers(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, Authorization: "Bearer " + key } : extra;
}

// fetch with the key; a non-2xx answer throws with the API's error message.
export async function call(path, options = {}) {
  const response = await fetch(path, { ...options, headers: headers(options.headers || {}) });
  if (!response.ok) {
    let message = response.status + " " + response.statusText;
    try {
      const body = await response.json();
      message = body?.error?.message || body?.message || message;
    } catch {
      // not JSON: keep the status line
    }
    throw new Error(message);
  }
  return response;
}

export async function getJson(path) {
  return (await call(path)).json();
}

export async function postJson(path, body, signal) {
  return call(path, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
    signal,
  });
}

// Yields each parsed `data:` event of a server-sent-events stream until [DONE].
export async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}
