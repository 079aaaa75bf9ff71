// "Open in Perfetto UI": the UI's documented window.open + postMessage protocol.
// 1. open the UI in a new tab (inside the click's user activation, so no popup blocker);
// 2. fetch the selection's trace from this dashboard's /trace route;
// 3. post 'PING' to the tab until it answers 'PONG' (its message channel is not buffered);
// 4. post {perfetto: {buffer, title, fileName}}.
window.dash_clientside = Object.assign({}, window.dash_clientside, {
  megascope: {
    openPerfetto: function (nClicks, trace) {
      if (!nClicks || !trace || !trace.url) {
        return window.dash_clientside.no_update;
      }
      const uiUrl = trace.ui || "https://ui.perfetto.dev";
      const uiOrigin = new URL(uiUrl, window.location.href).origin;
      const ui = window.open(uiUrl);
      if (!ui) {
        return "the browser blocked the new tab; allow pop-ups for this page";
      }
      const status = document.getElementById("timeline-perfetto-status");
      const say = (text) => { if (status) { status.textContent = text; } };
      fetch(trace.url, { credentials: "same-origin" })
        .then((response) => {
          if (!response.ok) {
            return response.text().then((text) => { throw new Error(text); });
          }
          return response.arrayBuffer();
        })
        .then((buffer) => {
          let answered = false;
          const timer = setInterval(() => ui.postMessage("PING", uiOrigin), 50);
          const onMessage = (event) => {
            if (event.source !== ui || event.data !== "PONG" || answered) {
              return;
            }
            answered = true;
            clearInterval(timer);
            window.removeEventListener("message", onMessage);
            ui.postMessage({ perfetto: { buffer: buffer, title: trace.title, fileName: trace.file } }, uiOrigin);
            say("sent " + buffer.byteLength.toLocaleString() + " bytes to the Perfetto UI");
          };
          window.addEventListener("message", onMessage);
          setTimeout(() => {
            if (!answered) {
              clearInterval(timer);
              window.removeEventListener("message", onMessage);
              say("the Perfetto UI did not answer within 30 s; use Download instead");
            }
          }, 30000);
        })
        .catch((error) => say("trace export failed: " + error.message));
      return "opening the Perfetto UI...";
    },
  },
});
