// The views of the other tasks, shown only when the server serves them:
// an embeddings similarity playground ("embed") and a transcription page
// ("transcription").

import { call, postJson } from "./api.js";

function cosine(a, b) {
  let dot = 0;
  let na = 0;
  let nb = 0;
  for (let k = 0; k < a.length; k++) {
    dot += a[k] * b[k];
    na += a[k] * a[k];
    nb += b[k] * b[k];
  }
  return dot / Math.sqrt(na * nb);
}

export function setUpTools(model, showError) {
  document.getElementById("embed-run").addEventListener("click", async () => {
    const input = [document.getElementById("embed-a").value, document.getElementById("embed-b").value];
    try {
      const body = await (await postJson("/v1/embeddings", { model: model(), input })).json();
      const [a, b] = body.data.map((d) => d.embedding);
      document.getElementById("embed-result").textContent = cosine(a, b).toFixed(4);
    } catch (error) {
      showError(error);
    }
  });
  document.getElementById("transcribe-run").addEventListener("click", async () => {
    const file = document.getElementById("audio-file").files[0];
    if (!file) return;
    const form = new FormData();
    form.append("file", file);
    form.append("model", model());
    try {
      const body = await (await call("/v1/audio/transcriptions", { method: "POST", body: form })).json();
      document.getElementById("transcript").textContent = body.text;
    } catch (error) {
      showError(error);
    }
  });
}
