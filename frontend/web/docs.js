// Starts Swagger UI (/docs) or ReDoc (/redoc) on the schema at /openapi.json,
// fetched with the key the web UI stored, if any (the pages themselves need
// none). Loaded as a file: the pages' policy forbids inline script.

(async () => {
  const key = localStorage.getItem("pagoda.apiKey") || "";
  const auth = key ? { Authorization: "Bearer " + key } : {};
  const response = await fetch("/openapi.json", { headers: auth });
  const root = document.body;
  if (!response.ok) {
    root.textContent = `GET /openapi.json: ${response.status}; enter the API key on the chat page (/) first.`;
    return;
  }
  const spec = await response.json();
  if (root.dataset.docs === "swagger") {
    window.SwaggerUIBundle({
      spec,
      dom_id: "#swagger-ui",
      deepLinking: true,
      // "Try it out" calls carry the key too.
      requestInterceptor: (request) => {
        if (key) request.headers.Authorization = "Bearer " + key;
        return request;
      },
    });
  } else {
    window.Redoc.init(spec, {}, document.getElementById("redoc"));
  }
})();
